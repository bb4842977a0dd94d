"""The value types every layer shares, at the bottom of the package: the routing result and the
router that makes it (:mod:`~moeflow.core.routing`), the capacity formula, the slot map, the
statistics of a forward, expert compute and its buffers. Nothing here imports another moeflow
package but :mod:`moeflow.config`."""
