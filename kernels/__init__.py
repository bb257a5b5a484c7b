"""loraserve kernels: GPU ops (Triton) with pure-PyTorch twins; imports only torch and triton."""
