"""The model side of a step: the device, the packed model input, the model runner, CUDA graphs and memory profiling."""
