"""How one layer call's tokens reach the experts that compute them and come back: the dispatcher
protocol (:mod:`moeflow.parallel.dispatchers.protocol`), the load agreement every call runs first
(:mod:`moeflow.parallel.agreement`), the choice between them (:mod:`moeflow.parallel.dispatchers.choice`)
and the dispatchers themselves: ``capacity``, ``local``, ``packed``, ``gathered`` and ``rows``."""
