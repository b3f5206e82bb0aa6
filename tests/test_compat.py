"""deepspeed/compat.py: every DeepSpeed internal named once, checked, and the only way in."""

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from acco_ds.deepspeed import compat
from acco_ds.deepspeed.compat import DeepSpeedIncompatible, check_deepspeed, check_instance

PACKAGE = Path(compat.__file__).resolve().parents[1]
GLUE = sorted((PACKAGE / "deepspeed").glob("*.py")) + sorted((PACKAGE / "config").glob("*.py"))
# Attributes of DeepSpeed classes that are torch's (nn.Module, torch.optim) or plain Python, not DeepSpeed's.
NOT_DEEPSPEED = {"train", "eval", "compile", "type", "register_state_dict_pre_hook",
                 "register_state_dict_post_hook", "state_dict", "load_state_dict", "step", "device", "world_size",
                 "buffers", "parameters", "modules"}


def test_every_listed_internal_resolves_on_the_installed_deepspeed():
    resolved = check_deepspeed()
    assert len(resolved) == len(compat.IMPORTS)
    assert all(value is not None for value in resolved.values())
    assert compat._LOW <= compat._installed_version() < compat._HIGH


def test_a_missing_method_is_named_with_what_it_is_for_and_the_supported_range(monkeypatch):
    monkeypatch.delattr(compat.DeepSpeedZeroOptimizer, "_lazy_init_hp_params_optimizer_state")
    with pytest.raises(DeepSpeedIncompatible) as err:
        check_deepspeed()
    text = str(err.value)
    assert "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state does not exist" in text
    assert "as stock step() does" in text
    assert "deepspeed>=0.19,<0.20" in text and "pip install" in text


def test_a_missing_module_level_name_is_named(monkeypatch):
    import deepspeed.runtime.engine as ds_engine
    monkeypatch.delattr(ds_engine, "BFLOAT16")
    with pytest.raises(DeepSpeedIncompatible, match=r"deepspeed\.runtime\.engine\.BFLOAT16 does not exist"):
        check_deepspeed()


def test_a_changed_signature_is_named_with_both_parameter_lists(monkeypatch):
    monkeypatch.setattr(compat.DeepSpeedEngine, "_get_rank_zero_ckpt_name",
                        lambda self, checkpoints_path, tag, dp_rank: None)
    with pytest.raises(DeepSpeedIncompatible) as err:
        check_deepspeed()
    assert ("DeepSpeedEngine._get_rank_zero_ckpt_name takes (checkpoints_path, tag, dp_rank) where acco_ds "
            "passes (checkpoints_path, tag, mp_rank, dp_rank, bf16_mode)") in str(err.value)


def test_an_instance_without_an_attribute_acco_reads_is_refused():
    config = SimpleNamespace(zero_optimization_stage=1, zero_config=None, gradient_accumulation_steps=1,
                             world_size=2, managed_gradient_accumulation=True)
    with pytest.raises(DeepSpeedIncompatible, match=r"DeepSpeedConfig\.optimizer_name is not set by its "
                                                    r"constructor.*for an optimizer is required"):
        check_instance(config, "DeepSpeedConfig")
    config.optimizer_name = "adamw"
    with pytest.raises(DeepSpeedIncompatible, match=r"DeepSpeedConfig\.optimizer_params is not set"):
        check_instance(config, "DeepSpeedConfig")
    config.optimizer_params = None
    check_instance(config, "DeepSpeedConfig")


def test_fused_adamw_reads_the_mode_of_deepspeeds_fused_adam_only():
    import torch
    p = torch.nn.Parameter(torch.zeros(2))
    assert compat.fused_adamw(torch.optim.AdamW([p])) is None
    fused = object.__new__(compat.FusedAdam)  # no native build needed to read the flag
    fused.adam_w_mode = False
    assert compat.fused_adamw(fused) is False
    del fused.adam_w_mode
    with pytest.raises(DeepSpeedIncompatible, match="FusedAdam.adam_w_mode"):
        compat.fused_adamw(fused)


def _imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            yield node.args[0].value


def test_only_compat_imports_deepspeed():
    # ops/builder.py is the one exception: setup.py loads that file alone, without the package.
    allowed = {PACKAGE / "deepspeed" / "compat.py", PACKAGE / "ops" / "builder.py"}
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path not in allowed for name in _imports_of(path)
                 if name == "deepspeed" or name.startswith("deepspeed.")]
    assert offenders == []


def test_the_host_free_layers_import_no_host():
    """runtime/, algorithms/, testing/ and the torch host are read and tested without DeepSpeed: they import
    neither ``deepspeed`` nor ``acco_ds.deepspeed``; importing the torch host loads no DeepSpeed module."""
    code = "import sys, acco_ds.torch; print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    offenders = []
    for room in ("runtime", "algorithms", "testing", "torch"):
        for path in sorted((PACKAGE / room).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                for name in names:
                    if re.match(r"^(deepspeed|acco_ds\.deepspeed|\.\.+deepspeed)(\.|$)", name):
                        offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offenders == []


def _deepspeed_members(cls) -> set:
    names = set(dir(cls))
    for klass in cls.__mro__:
        try:
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=", inspect.getsource(klass)))
        except (OSError, TypeError):
            pass
    return names


def test_every_deepspeed_attribute_the_glue_touches_is_listed():
    """A new use of a DeepSpeed internal in the glue without an entry in compat fails here."""
    members = _deepspeed_members(compat.DeepSpeedEngine) | _deepspeed_members(compat.PipelineEngine) | \
        _deepspeed_members(compat.DeepSpeedZeroOptimizer)
    defined_by_acco = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    getattr(node.value, "id", None) == "self" and node.attr not in members:
                defined_by_acco.add(node.attr)
    listed = {name for _, name, _, _ in compat.METHODS}
    listed |= {name for entries in compat.INSTANCE_ATTRIBUTES.values() for name, _ in entries}
    used = set()
    for path in GLUE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.FunctionDef):  # an override of a DeepSpeed method
                used.add(node.name)
    unlisted = sorted(name for name in used & members
                      if not name.startswith("__") and name not in listed | NOT_DEEPSPEED | defined_by_acco)
    assert unlisted == [], ", ".join(unlisted)


def test_the_autoep_registry_mend_is_limited_to_the_call_that_fails(monkeypatch):
    """DeepSpeed 0.19's AutoEP calls ``registry.get(key, default)``; transformers 5.24's registry takes no
    default. The mend gives it one for string keys, leaves other keys to the original, does nothing where the
    call works or on another DeepSpeed, and wraps once."""
    import types

    from acco_ds.deepspeed import compat

    class Registry(dict):
        def get(self, model):  # transformers >= 5.24: no default
            return {"model": model}

    module = types.SimpleNamespace(_CanRecordRegistry=Registry)
    utils = types.SimpleNamespace(output_capturing=module)
    for name, fake in (("transformers", types.SimpleNamespace(utils=utils)), ("transformers.utils", utils),
                       ("transformers.utils.output_capturing", module)):
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(compat.package(), "__version__", "0.20.0")
    compat.mend_autoep_recorder_registry()
    with pytest.raises(TypeError):
        Registry().get("key", None)  # another DeepSpeed: left alone
    monkeypatch.setattr(compat.package(), "__version__", "0.19.8")
    compat.mend_autoep_recorder_registry()
    compat.mend_autoep_recorder_registry()
    r = Registry(a=1)
    assert r.get("a", 0) == 1 and r.get("b", 7) == 7 and r.get("b") is None and r.get(5) == {"model": 5}
    assert getattr(Registry.get, "_acco_mend", False)
