"""Loading: finding a model (a directory, a .gguf file, the embedded model), reading and converting its weights, and the tiny random models and HF reference runs the tests and benchmarks use."""
