"""Fused layer kernels the models call: RMSNorm (with the residual add), SiLU-and-multiply,
rotary embedding. Each op is one function that runs a Triton kernel on CUDA tensors and the
torch reference elsewhere (kernels/reference.py: the CPU's path, and what the kernels are
tested against)."""
