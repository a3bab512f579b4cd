"""The engine's house rules: imports run one way, no hidden state carried between models or
steps, and every public `zero.*` function takes NNX objects and typed PRNG keys."""

import ast
import gc
import pathlib
import re
import signal
import subprocess
import sys
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import batches, initial_state, make_init, train_step
from flax import nnx
from flax.training import train_state
from test_interop import write_safetensors
from test_tensor_parallel import RULES, mesh_2d
from test_tensor_parallel import data as tp_data
from test_tensor_parallel import init_fn as tp_init

import zerojax as zj
from zerojax.core.rules import StateLayout

PACKAGE = pathlib.Path(zj.__file__).parent


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    """{module: {(imported zerojax module, names)}} from every import statement, the ones
    inside functions included (a lazy import is still an arrow between two modules)."""
    modules = {_module(f): f for f in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in modules}
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerojax"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add((sub if sub in modules else node.module, alias.name))
            elif isinstance(node, ast.Import):
                graph[name] |= {(a.name, "") for a in node.names if a.name in modules}
    return graph


def test_imports_run_one_way_and_touch_no_private_name():
    graph = _imports()
    private = [
        (m, t, n) for m, edges in graph.items() for t, n in edges if n.startswith("_") and t != m
    ]
    assert not private, f"private names imported across modules: {private}"
    arrows = {m: {t for t, _ in edges if t not in (m, "zerojax")} for m, edges in graph.items()}

    def cycle_from(start, here, seen):
        for nxt in arrows.get(here, ()):
            if nxt == start:
                return [*seen, nxt]
            if nxt not in seen:
                found = cycle_from(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    cycles = [c for m in arrows if (c := cycle_from(m, m, [m]))]
    assert not cycles, f"import cycles: {cycles}"


def _table() -> list[tuple[str, set, set]]:
    """[(layer, {folder}, {module file under zerojax/})] of docs/design.md's layer table, from
    the top layer down."""
    section = (PACKAGE.parent / "docs" / "design.md").read_text().split("## 1. Layers")[1]
    rows = []
    for line in section.split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 6 or cells[1] in ("layer", "---"):
            continue
        folders = {f.rstrip("/") for f in re.findall(r"`([\w/]+)`", cells[2])}
        rows.append((cells[1], folders, set(re.findall(r"`([\w/]+)\.py`", cells[3]))))
    return rows


def _layers() -> list[tuple[str, set]]:
    """[(layer, {module})] of the layer table, from the top layer down."""
    dotted = lambda f: ".".join(["zerojax", *f.split("/")]).removesuffix(".__init__")
    return [(name, {dotted(f) for f in files}) for name, _, files in _table()]


def test_folders_follow_the_layers_of_the_design():
    """Each module lives in its row's folder (Flax's adapters in flax/, in the row of what they
    adapt) and each folder's rows are adjacent: the tree read top-down is the layers."""
    table = _table()
    misplaced = [
        f"{f} ({name}: {sorted(folders)})"
        for name, folders, files in table
        for f in files
        if (f.rsplit("/", 1)[0] if "/" in f else "zerojax") not in folders
    ]
    assert not misplaced, f"modules outside their row's folder: {misplaced}"
    for folder in {f for _, folders, _ in table for f in folders}:
        rows = [i for i, (_, folders, _) in enumerate(table) if folder in folders]
        assert rows == list(range(rows[0], rows[-1] + 1)), f"{folder}/ spans rows {rows}"
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    named = {f for _, folders, _ in table for f in folders} | {"flax", "models"}
    assert on_disk <= named, f"folders the table does not name: {sorted(on_disk - named)}"


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "zerojax"


def test_folders_import_downward_only():
    """Folders in the order the table first names them (commands, the API, inspect/io,
    engine, flax, comm, update, deepspeed, core): no import from a folder to one above it."""
    order = []
    for _, _, files in _table():
        for f in files:  # a row's folders in the order its modules list them
            folder = f.split("/")[0] if "/" in f else "zerojax"
            if folder not in order:
                order.append(folder)
    rank = {folder: i for i, folder in enumerate(order)}
    upward = {
        (m, t)
        for m, edges in _imports().items()
        for t, _ in edges
        if _folder(m) in rank and _folder(t) in rank and rank[_folder(t)] < rank[_folder(m)]
    }
    assert not upward, sorted(upward)
    assert order.index("flax") < order.index("comm") and order.index("engine") < order.index("flax")


def test_imports_go_down_the_layers_of_the_design():
    layers = _layers()
    row = {m: i for i, (_, mods) in enumerate(layers) for m in mods}
    listed = [m for _, mods in layers for m in mods]
    modules = {m for m in _imports() if not m.startswith("zerojax.models")}
    assert sorted(listed) == sorted(modules), "each module in exactly one row of the table"
    upward = [
        f"{m} ({layers[row[m]][0]}) imports {t} ({layers[row[t]][0]})"
        for m, edges in _imports().items()
        if m in row
        for t, _ in edges
        if t in row and row[t] < row[m]
    ]
    assert not upward, upward


@pytest.mark.parametrize("order", [1, -1])
def test_modules_import_in_either_order(order):
    names = [
        "zerojax.flax.nnx",
        "zerojax.engine.step",
        "zerojax.core.config",
        "zerojax.core.deepspeed_json",
    ][::order]
    code = f"import {', '.join(names)}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def _sources():
    return {_module(f): f.read_text() for f in PACKAGE.rglob("*.py")}


def _functions():
    """{(module, name): function node} of every function in the package."""
    return {
        (_module(f), node.name): node
        for f in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _parameters(node) -> list:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return [p for p in names if p.arg not in ("self", "cls")]


def test_functions_stay_short_enough_to_read():
    # a function over 80 lines holds several decisions; in the engine, the core and the
    # adapters (what every step runs through) none is over 60 lines or takes more than 6
    # parameters: a clump of values travels as one frozen value (Variant, Site, UpdateCall)
    functions = _functions()
    length = {k: n.end_lineno - n.lineno + 1 for k, n in functions.items()}
    assert not {k: n for k, n in length.items() if n > 80}
    engine = [
        k for k in functions if k[0].split(".")[1:2] in (["engine"], ["core"], ["flax"], ["update"])
    ]
    assert len(engine) > 200  # the test reads those folders at all
    assert not {k: length[k] for k in engine if length[k] > 60}
    assert not {
        k: len(_parameters(functions[k])) for k in engine if len(_parameters(functions[k])) > 6
    }


def _view_options() -> dict:
    """{view: the ZeroConfig options its `of` reads} for each frozen policy view."""
    tree = ast.parse((PACKAGE / "core" / "policy.py").read_text())
    views = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        of = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "of"), None)
        if of is not None:
            views[cls.name] = {
                n.attr for n in ast.walk(of) if isinstance(n, ast.Attribute) and _is(n.value, "cfg")
            }
    return views


def _is(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def test_no_function_takes_the_config_where_a_policy_view_exists():
    """A function taking the whole ZeroConfig reads more than any one view holds (the views
    are computed once per zero_shard, as Comm is for axes); below the API, the step, the hook,
    the adapters and the update take views, never the config."""
    views = _view_options()
    assert set(views) == {"UnitPolicy", "UpdatePolicy"} and all(views.values())
    wrong = []
    for (module, name), node in _functions().items():
        for p in _parameters(node):
            annotated = p.annotation is not None and "ZeroConfig" in ast.unparse(p.annotation)
            if not annotated or name == "of":
                continue
            reads = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute) and _is(n.value, p.arg)
            }
            covered = [v for v, options in views.items() if reads and reads <= options]
            if covered:
                wrong.append(
                    f"{module}.{name}({p.arg}) reads only {sorted(reads)}: take {covered[0]}"
                )
    assert not wrong, wrong
    # what a step runs through; placement resolves the views and state reads the model's own
    # declared layout (axis, logical_rules), for which no view exists
    readers = ("engine.step", "engine.traced", "engine.variant", "engine.hook", "engine.local_step")
    readers += ("engine.budget", "flax.unit_calls", "flax.units", "flax.nnx_managed", "update.")
    taking = [
        f"{module}.{name}"
        for (module, name), node in _functions().items()
        if module.startswith(tuple(f"zerojax.{r}" for r in readers))
        for p in _parameters(node)
        if p.annotation is not None
        and "ZeroConfig" in ast.unparse(p.annotation)
        or p.arg in ("cfg", "config")
    ]
    assert not taking, taking


def test_the_step_never_receives_the_api_object():
    """ZeroStep is built from values (a Placement and a layout function), never a ZeroShard:
    every construction passes `.placement`, and nothing under engine/ names the API object."""
    calls = [
        node
        for f in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Call) and _is(node.func, "ZeroStep")
    ]
    assert calls and all(
        isinstance(c.args[0], ast.Attribute) and c.args[0].attr == "placement" for c in calls
    )
    init = _functions()[("zerojax.engine.step", "__init__")]
    assert ast.unparse(_parameters(init)[0].annotation) == "Placement"
    engine = {m: src for m, src in _sources().items() if m.startswith("zerojax.engine")}
    assert not [m for m, src in engine.items() if "ZeroShard" in src or "type(zero)" in src]


def test_a_step_is_constructible_without_a_zero_shard():
    from zerojax.engine.placement import Placement
    from zerojax.engine.step import ZeroStep
    from zerojax.shard import ZeroShard

    config = zj.ZeroConfig(stage=3, persistence_threshold=0)
    placement = Placement.resolve(config)

    def layout(tree, stacks=None):  # any function giving the state's layout: the rules, uncached
        from zerojax.core.rules import plan_state

        return plan_state(tree, placement.config, placement.comm.shard_size, stacks=stacks)

    zero = ZeroShard(config)
    state = zero.init(make_init(optax.adam(1e-3)), jax.random.key(0))
    batch = batches(1)[0]
    alone = ZeroStep(placement, train_step, layout)
    assert alone.lower(state, batch).as_text() == zero(train_step).lower(state, batch).as_text()


def test_the_inert_option_warning_reads_the_resolved_options():
    # 'auto' accumulation known to be one micro-batch on 8 devices: accumulate is inert
    with pytest.warns(zj.ZeroWarning, match=r"accumulate='reduced' does nothing with one micro"):
        zj.zero_shard(stage=1, train_batch_size=16, micro_batch_size=2, accumulate="reduced")


def test_one_context_variable_and_no_module_state_written_while_tracing():
    # what the traced step hands to the code Flax and optax call back travels in one frozen
    # trace_scope.Scope; no module keeps a list or dict it fills (caches are functools')
    sources = _sources()
    holding = [m for m, src in sources.items() if "ContextVar(" in src]
    assert holding == ["zerojax.core.trace_scope"]
    filled = []
    for f in PACKAGE.rglob("*.py"):
        text = f.read_text()
        for node in ast.parse(text).body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and isinstance(value, (ast.Dict, ast.List, ast.Set)):
                writes = rf"\b{target.id}(\[[^]]*\] =|\.(append|add|update|pop|setdefault)\()"
                if re.search(writes, text):
                    filled.append(f"{_module(f)}.{target.id}")
    # written once, as zerojax sets XLA_FLAGS (at import, or as `zerojax plan` starts): no trace
    assert filled == ["zerojax.core.xla_flags._STATUS"], (
        f"module-level containers written: {filled}"
    )


def test_the_trace_scope_nests_and_restores():
    from zerojax.core.trace_scope import OUTSIDE, current, scoped

    with scoped(running_model=True):
        with scoped(inside_unit=True):
            assert current().running_model and current().inside_unit
        assert current().running_model and not current().inside_unit
        with pytest.raises(RuntimeError), scoped(discovery={}):
            raise RuntimeError("a trace that fails")
        assert current().discovery is None  # restored, the exception notwithstanding
    assert current() is OUTSIDE


def test_zero_error_comes_from_core_errors():
    # not through core.config (which made everything depend on the DeepSpeed reader)
    sources = [
        (m, t) for m, edges in _imports().items() for t, name in edges if name == "ZeroError"
    ]
    assert sources and {t for _, t in sources} == {"zerojax.core.errors"}, sources


def test_the_paths_a_release_documented_still_import():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import zerojax as zj\n"
        "try:\n"
        "    import zerojax.launch\n"
        "except zj.ZeroWarning as e:\n"
        "    assert 'zerojax.commands.launch' in str(e), e\n"
        "warnings.simplefilter('ignore')\n"
        "import zerojax.launch\n"
        "assert zerojax.launch.initialize is zj.initialize\n"
        "from zerojax.hlo import matmul_flops\n"
        "from zerojax.engine.optim import ZeroOptState\n"
        "from zerojax.deepspeed.reader import options_from_deepspeed\n"
        "import zerojax.inspect.hlo as hlo; assert matmul_flops is hlo.matmul_flops\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_one_hlo_instruction_grammar():
    # inspect/ reads HLO text through inspect/hlo.py alone: what an instruction line is (its
    # name, result type, opcode, operands), which computations it calls, a while's parts
    sources = _sources()
    assert [m for m, src in sources.items() if "(?:ROOT" in src] == ["zerojax.inspect.hlo"]
    assert [m for m, src in sources.items() if "body=%?" in src] == ["zerojax.inspect.hlo"]


def test_only_the_flax_adapters_import_flax():
    # how Linen and NNX calls are caught and their state split lives in zerojax/flax; the
    # engine, the collectives and the measurement know only pytrees (zerojax/models are examples)
    importing = set()
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "flax" or n.startswith("flax.") for n in names):
                importing.add(_module(f))
    outside = {m for m in importing if not m.startswith(("zerojax.flax.", "zerojax.models."))}
    assert not outside, f"modules importing flax outside zerojax/flax: {sorted(outside)}"
    assert "zerojax.flax.model_calls" in importing  # the test reads imports at all


def test_only_the_boundary_asks_what_kind_of_state_it_has():
    # zerojax.engine.state turns every kind of user state into the one pytree the engine sees
    # (the NNX adapter says what an NNX object is; only the boundary asks it)
    sources = _sources()
    assert [m for m, src in sources.items() if "nnx.Pytree" in src] == ["zerojax.flax.nnx"]
    asking = [m for m, src in sources.items() if "is_nnx_object(" in src]
    assert sorted(asking) == ["zerojax.engine.state", "zerojax.flax.nnx"]


def test_only_the_rules_decide_a_spec():
    # a leaf's layout is decided once (rules.plan_state, cached by ZeroShard.layout); the hook,
    # the gathers, the step's gradients, report and describe read it
    deciding = [m for m, src in _sources().items() if "split_spec(" in src]
    assert deciding == ["zerojax.core.rules"]
    stage_numbers = [
        m
        for m, src in _sources().items()
        for line in src.splitlines()
        if "stage" in line
        and any(op in line for op in ("stage >", "stage <", "stage ==", "stage !="))
        and m != "zerojax.core.config"
    ]
    assert not stage_numbers, f"stage compared outside ZeroConfig's properties: {stage_numbers}"
    # likewise what a precision or an offload implies (uses_16bit, scales_loss, offloads_params,
    # updates_on_host...)
    precisions = [
        m
        for m, src in _sources().items()
        for line in src.splitlines()
        if re.search(r"(precision|offload_\w+) (==|!=|in) ", line) and m != "zerojax.core.config"
    ]
    assert not precisions, f"compared outside ZeroConfig's properties: {precisions}"


def test_a_layout_is_computed_once_per_structure():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    state = zero.init(plain_init, jax.random.key(0))
    layout = zero.layout(state)
    # computed once: another state of the same model (here its abstract shape) shares the plans
    assert zero.layout(zero.eval_shape(plain_init, jax.random.key(0))).plans is layout.plans
    kernel = layout.params["Dense_0/kernel"]
    assert kernel.spec == kernel.sharded_spec == kernel.grad_spec  # stage 3: all split
    assert kernel.split_dim is not None and kernel.spec[kernel.split_dim] == "data"
    two = zj.zero_shard(stage=2, persistence_threshold=0).layout(state).params["Dense_0/kernel"]
    assert two.spec == jax.sharding.PartitionSpec() and two.grad_spec == kernel.sharded_spec


class PlainHead(nn.Module):
    """A model whose parameter paths coincide with the tensor-parallel model's head
    (`Dense_0/kernel`, (32, 64)) but which declares no partitioning."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        return nn.Dense(64)(nn.Dense(32)(x))


def plain_init(key):
    model = PlainHead()
    params = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _specs(zero, state):
    return {p.path: p.spec for p in zero.plan(state)}


@pytest.mark.filterwarnings("ignore:zerojax. logical_rules has nothing to map")
def test_one_zero_with_two_models_keeps_their_layouts_apart():
    fresh = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    alone = fresh.init(plain_init, jax.random.key(0))
    want = _specs(fresh, alone)
    zero = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    for init, batch in ((tp_init, tp_data(1)[0]), (plain_init, tp_data(1)[0]), (tp_init, None)):
        state = zero.init(init, jax.random.key(0))
        if batch is not None:
            step = zero(train_step)
            state, metrics = step(state, batch)
            assert np.isfinite(float(metrics["loss"]))
            assert zero.report(step, state, batch).peak_bytes > 0
        if init is plain_init:
            assert _specs(zero, state) == want  # nothing of the first model carried over
            kernel = state.params["Dense_0"]["kernel"]
            placed = jax.sharding.NamedSharding(kernel.sharding.mesh, want["params/Dense_0/kernel"])
            assert kernel.sharding.is_equivalent_to(placed, kernel.ndim)
        else:  # and the tensor-parallel model keeps its own layout after the plain one
            assert _specs(zero, state)["params/Dense_0/kernel"] == jax.sharding.PartitionSpec(
                "data", "model"
            )
    assert "model" not in str(want["params/Dense_0/kernel"])


def test_a_zero_keeps_nothing_between_calls_but_its_layout_cache():
    """A tensor-parallel layout is read from the state each time (its boxes, or the shardings
    of a placed state), never remembered: a zero that has seen the state's model before plans
    it exactly as a fresh one does. (It also keeps the causes it has warned about, to say each
    once.)"""
    zero = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    before = dict(vars(zero))
    state = zero.init(tp_init, jax.random.key(0))
    state, _ = zero(train_step)(state, tp_data(1)[0])
    assert {k: v for k, v in vars(zero).items()} == before  # the same objects, nothing added
    assert all(isinstance(v, StateLayout) for v in zero._layouts.values())
    assert all(isinstance(cause, str) for cause in zero.warned)
    fresh = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    assert fresh.plan(state) == zero.plan(state)
    assert _specs(fresh, state)["params/Dense_0/kernel"] == jax.sharding.PartitionSpec(
        "data", "model"
    )


class DropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(nnx.relu(self.up(x))))


def build():
    model = DropoutNet(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def test_every_public_function_takes_nnx_objects_with_rng_streams(tmp_path):
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = zero.init(build)
    plans = {p.path: p for p in zero.plan((model, optimizer))}
    assert plans["params/up/kernel"].spec == jax.sharding.PartitionSpec("data", None)
    assert plans["opt_state/opt_state/0/mu/up/kernel"].category == "opt_state"
    streams = [p for p in plans.values() if "/rngs/" in p.path]  # the dropout stream
    assert streams and all(p.category == "other" for p in streams)  # RNG streams: not params
    shardings = zero.state_shardings((model, optimizer))
    assert shardings["params"]["up"]["kernel"].spec == plans["params/up/kernel"].spec
    table = zero.describe((model, optimizer), show=False)
    assert {r.path for r in table.rows} == set(plans)
    abstract_model, _ = zero.eval_shape(build)  # abstract objects, shardings included
    kernel = abstract_model.up.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.sharding.spec == plans["params/up/kernel"].spec
    held = zero.abstract((model, optimizer))  # their dict state, as the zero holds it
    assert held["params"]["up"]["kernel"].sharding == shardings["params"]["up"]["kernel"]

    def step_fn(model, optimizer, batch):
        def loss_fn(model):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    batch = {"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 16), np.float32)}
    assert zero.report(zero(step_fn), model, optimizer, batch).peak_bytes > 0
    weights = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    file = tmp_path / "w.safetensors"
    tensors = _tensors(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors["up.kernel"] = weights
    write_safetensors(file, tensors)
    loaded_model, _ = zero.load_safetensors((model, optimizer), str(file))
    np.testing.assert_array_equal(np.asarray(loaded_model.up.kernel[...]), weights)
    assert loaded_model.up.kernel[...].sharding.spec == plans["params/up/kernel"].spec


class KeyedState(train_state.TrainState):
    rng: jax.Array  # a typed PRNG key, as `jax.random.key` makes them


def keyed_init(key):
    base = make_init(optax.adam(1e-3))(key)
    return KeyedState.create(apply_fn=base.apply_fn, params=base.params, tx=base.tx, rng=key)


def _tensors(params) -> dict:
    """{'a.b.kernel': array} for a nest of parameters, as a safetensors file names them."""
    return {
        ".".join(str(getattr(k, "key", k)) for k in p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }


@pytest.mark.filterwarnings("ignore:zerojax. .* of the bytes stage 3 should split")
def test_every_public_function_takes_typed_prng_keys(tmp_path):
    zero = zj.zero_shard(stage=3)
    state = zero.init(keyed_init, jax.random.key(0))
    plans = {p.path: p for p in zero.plan(state)}
    assert plans["rng"].category == "other" and plans["rng"].nbytes == 8
    assert zero.state_shardings(state).rng.spec == jax.sharding.PartitionSpec()
    row = {r.path: r for r in zero.describe(state, show=False).rows}["rng"]
    assert row.dtype == "key<fry>" and row.bytes_per_device == 8
    abstract = zero.eval_shape(keyed_init, jax.random.key(0))
    assert jax.dtypes.issubdtype(abstract.rng.dtype, jax.dtypes.prng_key)
    assert zero.abstract(state).rng.sharding == zero.state_shardings(state).rng
    batch = batches(1)[0]
    assert zero.report(zero(train_step), state, batch).peak_bytes > 0
    tensors = _tensors(state.params)
    kernel = tensors["head.kernel"] = tensors["head.kernel"] + 1
    write_safetensors(tmp_path / "w.safetensors", tensors)
    loaded = zero.load_safetensors(state, str(tmp_path / "w.safetensors"))
    np.testing.assert_array_equal(np.asarray(loaded.params["head"]["kernel"]), kernel)
    assert jax.random.key_data(loaded.rng).tolist() == jax.random.key_data(state.rng).tolist()


def _device_bytes(arrays) -> int:
    """Bytes of the distinct device buffers behind `arrays` (a sharded array and the
    per-device arrays it caches share their buffers: count each buffer once)."""
    buffers = {}
    for x in arrays:
        for shard in x.addressable_shards:
            buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


def _live_bytes() -> int:
    return _device_bytes(jax.live_arrays())


def test_a_dropped_state_is_freed(tmp_path):
    """The step keeps no reference to the states it returns: once the caller drops one (to
    restore a checkpoint, say), no second copy stays in device memory."""
    zero = zj.zero_shard(stage=2, gradient_accumulation_steps=2, precision="bf16")
    step = zero(train_step)
    state = zero.shard(initial_state(optax.adam(1e-3)))
    for batch in batches(2, batch_size=8):
        state, metrics = step(state, batch)
    with zj.CheckpointManager(tmp_path / "ckpt", zero) as ckpt:
        ckpt.save(1, state)
    abstract = jax.eval_shape(make_init(optax.adam(1e-3)), jax.random.key(0))
    gone = [weakref.ref(x) for x in jax.tree_util.tree_leaves(state)]
    state_bytes = _device_bytes(jax.tree_util.tree_leaves(state))
    del state, metrics
    gc.collect()
    assert not [r for r in gone if r() is not None]  # every leaf of the dropped state freed
    before = _live_bytes()
    with zj.CheckpointManager(tmp_path / "ckpt", zero) as ckpt:
        restored, _ = ckpt.restore(abstract)
    gc.collect()
    assert _live_bytes() - before == _device_bytes(jax.tree_util.tree_leaves(restored))
    assert _live_bytes() - before <= state_bytes  # one state alive, not two
    restored, _ = step(restored, batches(1, batch_size=8)[0])  # and it trains on


def test_closing_a_checkpoint_manager_gives_sigterm_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = zj.CheckpointManager(tmp_path / "c", zj.zero_shard(stage=1), save_on_preemption=True)
    assert signal.getsignal(signal.SIGTERM) is not before
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_every_warning_is_a_zero_warning():
    """Users filter zerojax's warnings by category: every warning goes through `errors.warn`,
    the one `warnings.warn` call, which gives ZeroWarning at the user's line."""
    calls = []
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                category = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("category")
                calls.append((file.name, category))
    assert calls == [("errors.py", "ZeroWarning")], calls
    zero = zj.zero_shard(stage=3, logical_rules=RULES)
    with pytest.warns(zj.ZeroWarning, match="logical_rules has nothing to map") as caught:
        zero.shard(initial_state(optax.sgd(0.1)))
    assert [w.filename for w in caught] == [__file__]  # the user's line, not zerojax's
