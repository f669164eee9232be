"""The device a rank computes on: the `Backend` (NumPy on the CPU or CuPy on a GPU, chosen
once and passed explicitly) with its GPU binding by node-local rank (`backend`), its thread
pool (`threads`), its workspaces (`scratch`), the compute dtypes and what 16-bit compute
keeps in float32 (`dtypes`), memory needed against memory there is (`budget`), memory
held now and at most (`memory`), the GPUs' nominal peak FLOP/s (`peaks`), and the fused
CUDA kernels (`kernels`). The tools to develop and check them — the device stand-in, the
kernels' host build, the compile checks, the shape-only device and the GPU rates of the
cost model — live apart, in hpcpipe/devtools.

May import: `util`. Nothing else of hpcpipe; never MPI (a peer communicator is passed in
where ranks must agree on a device).
"""
