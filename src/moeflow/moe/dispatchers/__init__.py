"""How one layer call's tokens reach the experts that compute them and come back: the dispatcher
protocol (:mod:`moeflow.moe.dispatchers.protocol`), the load agreement every call runs first
(:mod:`moeflow.moe.agreement`), the choice between them (:mod:`moeflow.moe.dispatchers.choice`)
and the dispatchers themselves: ``capacity``, ``local``, ``packed``, ``gathered`` and ``rows``."""
