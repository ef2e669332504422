"""The public surface and the package's layering: what users import keeps working, and data flows one way.

The layout (docs/design.md): ``kernels/`` knows nothing of autograd or collectives; the data path
imports nothing from ``cli/`` or ``integrations/``; every private torch or Triton API is read in
``tritonbn/_compat.py`` alone.
"""

import ast
import importlib
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

import tritonbn

PACKAGE = pathlib.Path(tritonbn.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))

# The public names, pinned: a name dropped or renamed breaks users.
PUBLIC = (
    "SyncBatchNorm convert_sync_batchnorm revert_sync_batchnorm syncbn_group sync_batch_norm"
    " fuse_batchnorm_activations fold_batchnorm sync_running_stats recalibrate_batchnorm accumulate_stats"
    " join explain patch_sync_batchnorm unpatch_sync_batchnorm check OutOfStepError diagnose __version__"
).split()
KERNELS = ["Plan", "plan", "batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce",
           "batch_norm_backward_elemt", "Launchers"]  # fmt: skip
IMPORT_PATHS = [
    ("tritonbn.lightning", "TritonSyncBatchNorm"),
    ("tritonbn.mmengine", "NAME"),
    ("tritonbn.kernels.stats", "batch_norm_stats"),
    ("tritonbn.kernels.elemt", "batch_norm_elemt"),
    ("tritonbn.kernels.backward_reduce", "batch_norm_backward_reduce"),
    ("tritonbn.kernels.backward_elemt", "batch_norm_backward_elemt"),
    ("tritonbn.diagnose", "check_bn_sync"),
    ("tritonbn.diagnose", "find_unsynced_batchnorm"),
    ("tritonbn.functional", "sync_batch_norm"),
    ("tritonbn.modules", "SyncBatchNorm"),
    ("tritonbn.convert", "convert_sync_batchnorm"),
    ("tritonbn.running_stats", "accumulate_stats"),
    ("tritonbn.uneven", "join"),
    ("tritonbn.lockstep", "OutOfStepError"),
    ("tritonbn.backend", "ops_for"),
    ("tritonbn.export", "fold_batchnorm"),
    ("tritonbn.patching", "patch_sync_batchnorm"),
    ("tritonbn.modules", "SyncBatchNorm2d"),
]


def test_public_names():
    assert tritonbn.__all__ == PUBLIC
    assert all(getattr(tritonbn, name) is not None for name in PUBLIC)
    assert tritonbn.SyncBatchNorm.convert_sync_batchnorm.__func__ is not None
    assert importlib.import_module("tritonbn.kernels").__all__ == KERNELS
    assert tritonbn.__version__ == importlib.metadata.version("tritonbn")


@pytest.mark.parametrize(("module", "name"), IMPORT_PATHS)
def test_import_paths(module, name):
    assert hasattr(importlib.import_module(module), name)


def test_kept_paths_are_the_integrations():
    import tritonbn.integrations.lightning
    import tritonbn.integrations.mmengine
    import tritonbn.lightning
    import tritonbn.mmengine

    assert tritonbn.lightning.TritonSyncBatchNorm is tritonbn.integrations.lightning.TritonSyncBatchNorm
    assert tritonbn.mmengine.NAME == tritonbn.integrations.mmengine.NAME == "TritonSyncBN"


def test_command_line_entry_points():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "tritonbn"]
    assert script.value == "tritonbn.cli:main"
    out = subprocess.run([sys.executable, "-m", "tritonbn", "--help"], capture_output=True, text=True, check=True)
    assert all(command in out.stdout for command in ("demo", "bench", "doctor")), out.stdout


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("tritonbn." + (node.module or ""))  # relative imports stay inside the package
    return names


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


# The floors of the package, lowest first: a module imports only from its own floor or below (docs/design.md).
FLOORS = [
    ("tritonbn._compat", "tritonbn._numerics", "tritonbn.activations"),
    ("tritonbn.backends",),
    ("tritonbn.kernels", "tritonbn.backend", "tritonbn.distributed", "tritonbn.groups", "tritonbn._signature",
     "tritonbn._norm_layers", "tritonbn.lockstep"),
    ("tritonbn._core",),
    ("tritonbn.functional", "tritonbn.modules", "tritonbn.convert"),
    ("tritonbn.fusion", "tritonbn.export", "tritonbn.diagnose", "tritonbn.running_stats", "tritonbn.uneven",
     "tritonbn._explain", "tritonbn.patching", "tritonbn"),
    ("tritonbn.cli", "tritonbn.integrations", "tritonbn.lightning", "tritonbn.mmengine", "tritonbn.__main__"),
]  # fmt: skip


def _floor(module: str) -> int:
    module = module.removesuffix(".__init__")
    found = [i for i, floor in enumerate(FLOORS) for prefix in floor
             if module == prefix or (prefix != "tritonbn" and module.startswith(prefix + "."))]  # fmt: skip
    assert found, f"{module} is on no floor of FLOORS: place it there (and in docs/design.md's map)"
    return max(found)


def _graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, anywhere in the file: ``from a import b``
    is an arrow to ``a.b`` where that is a module of its own, else to ``a``."""
    modules = {_name(p).removesuffix(".__init__") for p in MODULES}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for path in MODULES:
        module = _name(path).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(owner(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *[base][:1]])
                targets.update(owner(f"{base.rstrip('.')}.{a.name}") for a in node.names)
        graph[module] = {t for t in targets if t.startswith("tritonbn")} - {module}
    return graph


_IMPORT_CHECK = """
import sys, torch, tritonbn
heavy = {"lightning", "pytorch_lightning", "torch._dynamo"}
assert not heavy & set(sys.modules), heavy & set(sys.modules)
net = tritonbn.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)))
net(torch.randn(2, 3, 5, 5)).sum().backward()
with torch.no_grad():
    net.eval()(torch.randn(2, 3, 5, 5))
assert not heavy & set(sys.modules), heavy & set(sys.modules)
tritonbn.lightning
"""


def test_import_and_eager_steps_leave_out_lightning_and_dynamo():
    """``import tritonbn`` and eager training and eval steps import neither Lightning (imported by
    ``tritonbn.lightning`` alone) nor ``torch._dynamo`` (``torch.compile`` imports it; about half the time of
    ``import tritonbn`` when the subclass path's ``torch.compiler.disable`` was made at import)."""
    subprocess.run([sys.executable, "-c", _IMPORT_CHECK], check=True, timeout=120)


def test_no_import_cycle():
    graph = _graph()
    assert "tritonbn.backends.torch.masked" in graph and graph["tritonbn.backends.torch"], "the graph reads nothing"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, module, target]))
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_import_runs_back_up_a_floor():
    for module, targets in _graph().items():
        for target in targets:
            assert _floor(target) <= _floor(module), f"{module} (floor {_floor(module)}) imports {target} (floor " \
                                                     f"{_floor(target)}): an arrow back up"  # fmt: skip


def test_backends_know_nothing_above_them():
    """Backends and the kernels import nothing of autograd, modules, collectives or the CLI, and neither backend
    names the other (both name the launchers they implement, ``tritonbn.backends.launchers``); the PyTorch backend is
    a folder, a peer of the Triton backend's."""
    assert (PACKAGE / "backends" / "torch" / "__init__.py").is_file() and (PACKAGE / "backends" / "triton").is_dir()
    assert not list(PACKAGE.glob("_torch*.py")) and not list(PACKAGE.glob("_masked*.py"))
    allowed = ("tritonbn._compat", "tritonbn._numerics", "tritonbn.activations", "tritonbn.backends.launchers")
    paths = [*(PACKAGE / "backends").rglob("*.py"), *(PACKAGE / "kernels").glob("*.py")]
    for path in paths:
        own = _name(path).split(".")[:3]  # tritonbn.backends.<name>, or tritonbn.kernels
        for name in _imports(path):
            assert not name.startswith(("torch.distributed", "torch.autograd")), (_name(path), name)
            if not name.startswith("tritonbn"):
                continue
            mine = name.startswith(".".join(own)) or (
                own[1] == "kernels" and name.startswith("tritonbn.backends.triton")
            )
            assert mine or name.startswith(allowed) or name == "tritonbn.backends", (_name(path), name)


def test_data_path_imports_nothing_from_cli_or_integrations():
    kept = {"tritonbn.lightning", "tritonbn.mmengine", "tritonbn.__main__"}  # entry points at kept paths
    for path in MODULES:
        module = _name(path)
        if module.startswith(("tritonbn.cli", "tritonbn.integrations")) or module in kept:
            continue
        for name in _imports(path):
            assert not name.startswith(("tritonbn.cli", "tritonbn.integrations")), (module, name)


# Private torch and Triton attributes and modules, read in _compat.py alone.
_PRIVATE_ATTRS = {"_C", "_current_level", "_resolve_process_group", "_init_handles", "packed_metadata",
                  "_cuda_getCurrentRawStream", "launch_enter_hook", "launch_exit_hook",
                  "_is_exporting_flag"}  # fmt: skip
_PRIVATE_IMPORTS = ("triton.knobs", "triton.runtime.driver", "torch.distributed.distributed_c10d",
                    "torch.autograd.forward_ad")  # fmt: skip


def _private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in _PRIVATE_ATTRS]
    return found + [name for name in _imports(path) if name.startswith(_PRIVATE_IMPORTS)]


def test_private_apis_only_in_compat():
    assert _private_uses(PACKAGE / "_compat.py"), "the check finds nothing even where the private APIs are"
    for path in MODULES:
        if path.name != "_compat.py":
            assert not _private_uses(path), (_name(path), _private_uses(path))


def test_modules_stay_small():
    sizes = {_name(p): len(p.read_text().splitlines()) for p in MODULES}
    assert max(sizes.values()) <= 450, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
