"""The test harness, one package: how MPI tests run (spawned as jobs of their own —
`mpiworld`, `mpirun` —, or in-process under a launcher — `inlauncher`, `mpicontrol`,
`mpioutcome`, `watchdog` — with worker bodies of tests/mpi/ following `mpibody`), which
device the tests use (`devices`), what a run may not skip (`required`), a real Slurm for
the job scripts (`slurm`, `slurm_cluster`), and shared helpers (`gradcheck`, `hostile`,
`tokenfiles`, `flashmodel`: flash.cu's arithmetic in NumPy, the kernel tests' model). Tests import it as `from harness import mpirun` (conftest.py puts tests/
on the path)."""
