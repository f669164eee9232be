"""Tools for developing and checking the device code, apart from the runtime (as llm.c
keeps dev/cuda/ beside llmc/): the device stand-in (`standin`: CuPy's semantics on the
CPU, so the GPU code path runs in every test pass), the host build of the CUDA kernels
(`hostbuild`, `shim.h`: the unchanged .cu on the CPU, tensor-core instructions emulated
lane by lane; `rawmodule`: CuPy's RawModule over it), the compile checks for the GPU
(`compilecheck`: nvcc and NVRTC with ptxas's report), each kernel against NumPy on a
device (`ondevice`, for `make gpu-check`), the kernel-level cost model (`kernelmodel`)
and the step-level one's parts: the shape-only device that counts the GPU code path's
launches on a CPU (`shapes`) and the GPU rates that price them (`rates`), for `bench
gpu-model`.

The runtime (hpcpipe.device and everything that trains) never imports these, but for one
door: HPCPIPE_FAKE_GPU=1 makes device "gpu" the stand-in (device/backend.py), declared in
the import contract. May import the runtime's packages; never MPI.
"""
