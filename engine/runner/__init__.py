"""The model side of a step, behind one call (``protocol.Runner.execute(plan) -> StepOutput``):
the device, the packed model input, the model runner, CUDA graphs and memory profiling."""
