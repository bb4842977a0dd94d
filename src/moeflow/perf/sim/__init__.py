"""The simulator's machinery, below the techniques: cluster profiles (``profiles/``, ``models/``),
each collective priced on its links (:mod:`~moeflow.perf.sim.network`), the event engine with link
contention (:mod:`~moeflow.perf.sim.engine`), workloads, a step's knobs (:mod:`~moeflow.perf.sim.plan`)
and builder, and each technique's simulated half (:mod:`~moeflow.perf.sim.technique`,
``regions``, ``parm_regions``), which its record carries. The step and the joint planner, which
read the records, are :mod:`moeflow.sim`."""
