"""How one layer call's tokens reach the experts that compute them and come back: the dispatcher
protocol (:mod:`moeflow.parallel.dispatchers.protocol`), the choice of a call's dispatcher after the load
agreement (:mod:`moeflow.parallel.dispatchers.choice`) and the dispatchers themselves: ``capacity``,
``local``, ``kept_rows``, ``gathered`` and ``rows``."""
