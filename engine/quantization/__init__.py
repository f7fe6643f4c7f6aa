"""Weight quantisation: the packed block formats kept from a GGUF file, round-to-nearest
quantisers, the quantised linear layers and their CPU kernels' Python side, and the probe that
decides, per model and machine, which linears stay quantised. The model runner's one entry
point is ``prepare.prepare_weights``."""
