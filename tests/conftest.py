"""Every test runs on 8 simulated CPU devices (set before jax is imported)."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    # The suite is compile-bound (a few steps per configuration): XLA's CPU backend at LLVM
    # optimisation level 0 compiles 1.4-1.6x faster and runs steps 1.3-1.9x slower than at
    # level 2, its default (`python bench/compile_levels.py`). Numerics stay IEEE float32 (no
    # fast-math either way); the parity bounds in common.py hold at either level (checked at
    # 0 and 2, with --xla_cpu_max_isa=AVX2 too). Set the flag yourself for another level.
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # One persistent compilation cache per test session, inherited by the processes tests launch:
    # a restarted or second process (resume, multi-controller, CLI) loads what an earlier one
    # compiled instead of compiling it again. Empty at the start, so every session still
    # compiles everything once.
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="zerojax-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

# The quick lane for the edit loop (`pytest -m quick`, a few minutes on 2 cores): configs,
# rules tables, HLO parsing, quantisation, the house rules, and one small parity run per path
# (explicit collectives at stage 3 on 8 devices, and a deliberately broken reduction failing).
QUICK_MODULES = {
    "test_call_plan",
    "test_config",
    "test_data",
    "test_describe",
    "test_errors",
    "test_xla_flags",
    "test_architecture",
    "test_docs",
}
QUICK_TESTS = (
    "test_parity.py::test_stage_matches_single_device_adamw[3-8]",
    "test_parity.py::test_parity_checks_fail_on_a_broken_reduction[2-no_mean-sgd_momentum]",
    "test_parity.py::test_the_parity_check_passes_reduction_order_noise_and_fails_a_perturbed_leaf",
    "test_report.py::test_hlo_parser",
    "test_audit.py::test_an_audit_reads_dependencies_loops_and_relayouts",
    "test_report.py::test_collectives_in_a_loop",
    "test_report.py::test_matmul_flops_count_each_loop",
    "test_zeropp.py::test_int8",
    "test_zeropp.py::test_int4",
    "test_zeropp.py::test_iota_replica_groups",
    "test_zeropp.py::test_bad_options_are_named",
    "test_rules.py::test_default_rule_table",
    "test_rules.py::test_user_rules_by_path_regex",
    "test_rules.py::test_optimizer_state_follows_its_parameter",
    "test_rules.py::test_stage_placement_by_category",
    "test_tpu_compile.py::test_without_libtpu_the_error_names_the_extra",
    "test_option_sweep.py::test_every_option_is_swept",
    "test_option_sweep.py::test_an_unused_option_is_named",
    "test_stage0_invariant.py::test_every_module_class_the_suite_defines",
)


@pytest.fixture
def x64():
    """The test runs with jax_enable_x64 (float64 arrays kept float64): the dtype the exactness
    checks use (tests/common.py, "Parity"); `in_float64` casts a state to it."""
    import jax

    with jax.enable_x64(True):
        yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module else ""
        if module in QUICK_MODULES or any(q in item.nodeid for q in QUICK_TESTS):
            item.add_marker(pytest.mark.quick)


class FileProgress:
    """Under pytest-xdist (`-n`, the default), where test outcomes print as bare dots, one line
    per test file when its last test ends: its outcomes and the wall time from its first test's
    start."""

    def __init__(self, config):
        import collections

        self.config = config
        self.totals: collections.Counter = collections.Counter()
        self.outcomes: dict = collections.defaultdict(collections.Counter)
        self.ended: collections.Counter = collections.Counter()
        self.started: dict = {}

    def pytest_xdist_node_collection_finished(self, node, ids):
        if not self.totals:  # every worker collects the same tests
            self.totals.update(i.split("::")[0] for i in ids)

    def pytest_runtest_logreport(self, report):
        import time

        path = report.nodeid.split("::")[0]
        self.started.setdefault(path, time.monotonic())
        if report.failed:  # a failed setup or teardown is an error, as pytest counts it
            self.outcomes[path]["failed" if report.when == "call" else "error"] += 1
        elif report.skipped or (report.when == "call" and report.passed):
            self.outcomes[path][report.outcome] += 1
        if report.when == "teardown":
            self.ended[path] += 1
            if self.ended[path] == self.totals.get(path):
                counts = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes[path].items()))
                seconds = time.monotonic() - self.started[path]
                terminal = self.config.pluginmanager.get_plugin("terminalreporter")
                if getattr(getattr(terminal, "_tw", None), "width_of_current_line", 0):
                    terminal.write("\n")  # after the dots of this line
                terminal.write_line(f"{path}: {counts} in {seconds:.0f} s")


def pytest_configure(config):
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput"):  # the xdist controller
        config.pluginmanager.register(FileProgress(config), "zerojax-file-progress")
