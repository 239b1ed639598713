"""The oracle: independent simulators that replay plans and recompute makespan and peak.

One module per plan family (``checkpoint``, ``offload``, ``pipeline``); every method's plan
is replayed here before its result is reported or trusted by a test.
"""

from optmem.simulate.checkpoint import SimulationResult, Step, simulate_checkpoint, transition

__all__ = ["SimulationResult", "Step", "simulate_checkpoint", "transition"]
