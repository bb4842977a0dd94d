"""The MoE layer's wing, in the order one forward runs through it (cf. Megatron-Core's ``moe/``):

1. :mod:`~moeflow.core.routing`: the gate scores the tokens, picks each token's top-k experts and
   its slot in them (:mod:`~moeflow.core.capacity`: how many slots an expert has);
2. :mod:`~moeflow.parallel.agreement`: the load agreement, one all-gather of every rank's expert counts
   and whatever the dispatchers need agreed beside them;
3. :mod:`~moeflow.parallel.online_planner`: the online planner, the call's pipeline degree, all-to-all
   algorithm, exchange and r from the cost model and the measured load;
4. :mod:`~moeflow.parallel.dispatchers`: the tokens reach the experts and come back (the capacity
   exchange through the schedule, or a local, packed, gathered or row dispatcher);
5. :mod:`~moeflow.core.experts`: the expert FFNs on their slots;
6. :mod:`~moeflow.parallel.chunk_pipeline`: PipeMoE's chunked overlap of the experts with the exchange;
7. :mod:`~moeflow.moe.layer`: ``MoELayer``, which runs these steps and records them in
   :mod:`~moeflow.core.stats`.

Where the experts live and how an expert block runs over ranks (the schedules) is
:mod:`moeflow.parallel`. This package's ``__init__`` imports nothing, so the torch-free parts
(the capacity formula, the planner, the statistics' types) load without torch.
"""
