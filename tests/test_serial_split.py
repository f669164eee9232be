"""The split of `make test` into passes (conftest.py, harness/serial.py): the tests that
launch MPI jobs — directly, through another test module's function, or through an import
inside the test — are `serial`; the modules that only use harness.mpirun's helpers to
start one process are not; the stand-in pass leaves out the device tests that build their
own stand-in, which the CPU pass ran on it. Checked on real modules of the suite, by
collecting them as `make test` does."""

import subprocess
import sys

from harness.mpirun import ROOT, job_env

# module: whether its tests are serial, or the names of the tests that alone are (each
# imports `run` or `launcher` inside itself; its one-process neighbours run two at a time)
CASES = {
    "tests/checkpoint/test_checkpoint_mpi.py": True,  # imports `run`
    "tests/checkpoint/test_pipedream_checkpoint_mpi.py": True,  # test_checkpoint_mpi.train
    "tests/data/test_tokens_bin.py": False,  # ROOT, job_env: one process
    "tests/reliability/test_shared_run_dir.py": False,  # and test_preemption.wait_for_line
    "tests/train/test_cuda_graphs.py": (
        "test_data_parallel_with_graphs_reduces_what_the_eager_run_reduces",),
    "tests/bench/test_gpu_check.py": False,  # run_python: one process at a time
    "tests/bench/test_costmodel.py": False,  # run_python: one `bench gpu-model`
    "tests/data/test_hostile_token_files.py": False,  # run_python: one `train`
    "tests/cli/test_doctor.py": ("test_command_under_mpiexec_prints_one_report",
                                 "test_command_exits_1_on_a_problem_without_aborting",
                                 "test_doctor_checks_the_layout_it_is_given"),
    "tests/bench/test_bench_ckpt.py": (
        "test_a_tensor_parallel_checkpoint_is_saved_and_loaded_in_shards",),
    "tests/reliability/test_shards.py": (
        "test_optimizer_files_swapped_between_tensor_shards_are_refused",),
    "tests/bench/test_bench_pipeline.py": (
        "test_measured_peaks_equal_the_simulated_and_auto_is_never_worse",
        "test_splits_run_the_same_schedule_under_each_split_of_the_blocks"),
    "tests/bench/test_bench_stragglers.py": (
        "test_the_straggler_benchmark_runs_its_modes_in_turns",
        "test_a_slow_chip_is_late_inside_its_steps"),
    "tests/train/test_preemption.py": True,  # `start` launches; the rest marked
    "tests/train/test_preemption_saves.py": False,  # test_preemption.start_one: one process
}


def _collected(marks: str, modules=tuple(CASES), device: str = "cpu") -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", marks, "--device", device,
                           *modules], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def _name(test: str) -> str:
    """The test function of a collected id (its parameters left off)."""
    return test.split("::")[1].split("[")[0]


def test_serial_follows_what_a_test_launches():
    serial, parallel = _collected("serial"), _collected("not serial")
    for module, expected in CASES.items():
        ran = {test for test in serial | parallel if test.startswith(module + "::")}
        assert ran, f"{module}: no test collected"
        assert not serial & parallel, module
        if isinstance(expected, tuple):
            assert {_name(t) for t in ran & serial} == set(expected), module
            assert ran & parallel, f"{module}: no one-process test left to run two at a time"
        else:
            assert (ran <= serial) == expected and (ran <= parallel) == (not expected), module


# Device tests that build their own stand-in whatever --device says (the CPU pass runs
# them on it), and one that runs on the device --device names.
OWN_STANDIN = ("tests/model/test_fused.py", "tests/model/test_fused_llama.py")
ON_THE_DEVICE = "tests/device/test_standin.py::test_embedding_head_and_loss_on_the_device"


def test_the_stand_in_pass_leaves_out_what_the_cpu_pass_ran_on_the_stand_in():
    modules = (*OWN_STANDIN, ON_THE_DEVICE.split("::")[0])
    on_cpu = _collected("device", modules)
    assert {t.split("::")[0] for t in on_cpu} == set(modules)  # the CPU pass runs them all
    assert ON_THE_DEVICE in _collected("device", modules, "standin")
    assert not {t for t in _collected("device", modules, "standin")
                if t.startswith(OWN_STANDIN)}
    assert _collected("device", modules, "gpu") == on_cpu  # a GPU runs every device test
