"""The device a rank computes on: the `Backend` (NumPy on the CPU or CuPy on a GPU, chosen
once and passed explicitly) with its GPU binding by node-local rank (`backend`), its thread
pool (`threads`), its workspaces (`scratch`), the compute dtypes and what 16-bit compute
keeps in float32 (`dtypes`), memory needed against memory there is (`budget`), memory
held now and at most (`memory`), the GPUs' nominal peak FLOP/s (`peaks`), and the device
stand-in — CuPy's semantics on the CPU, so the GPU code path runs in every test pass
(`standin`).

May import: `util`. Nothing else of hpcpipe; never MPI (a peer communicator is passed in
where ranks must agree on a device).
"""
