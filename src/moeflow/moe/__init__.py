"""The MoE layer: glue that names the steps of one forward and calls the layers below for each
(cf. Megatron-Core's ``moe_layer.py``, torchtitan's ``moe.py``):

1. route: :mod:`moeflow.core.routing` scores the tokens and picks each token's top-k experts;
2. agree: :mod:`moeflow.parallel.agreement`, one all-gather of every rank's expert counts and whatever
   the dispatchers need agreed beside them, and :mod:`moeflow.parallel.dispatchers.choice`, the
   dispatcher that runs the call;
3. dispatch, experts, combine: :mod:`moeflow.parallel.dispatchers` (the capacity path plans the call
   with :mod:`moeflow.parallel.online_planner` and runs its schedule's exchange around the experts);
4. shared experts, then the record: :mod:`~moeflow.moe.layer` (``MoELayer``) keeps the aux loss and
   the statistics (:mod:`moeflow.core.stats`), and :mod:`~moeflow.moe.forward_memory` what a
   recompute repeats.

How tokens move is :mod:`moeflow.parallel`, below this package: one forward enters it once for the
load agreement through the statistics (``scripts/trace_forward.py``). This package's ``__init__``
imports nothing, so the torch-free planner loads without torch.
"""
