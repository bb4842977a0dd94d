"""The MoE layer, in the order one forward runs through it (cf. Megatron-Core's ``moe/``):

1. route: :mod:`moeflow.core.routing` scores the tokens and picks each token's top-k experts;
2. agree: :mod:`~moeflow.moe.agreement`, one all-gather of every rank's expert counts and whatever
   the dispatchers need agreed beside them, and :mod:`~moeflow.moe.dispatchers.choice`, the
   dispatcher that runs the call;
3. dispatch, experts, combine: :mod:`~moeflow.moe.dispatchers` (the capacity path plans the call
   with :mod:`~moeflow.moe.online_planner` and runs its schedule's exchange around the experts);
4. :mod:`~moeflow.moe.layer`: ``MoELayer``, which names these steps and records them in
   :mod:`moeflow.core.stats`; :mod:`~moeflow.moe.forward_memory`, what a recompute repeats.

Where the experts live and how a schedule moves rows is :mod:`moeflow.parallel`, below this
package. This package's ``__init__`` imports nothing, so the torch-free planner loads without torch.
"""
