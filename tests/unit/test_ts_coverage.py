"""batchserve's ``ts`` has every public name of TorchServe 0.12's ``ts`` package, with the same
signatures.

The truth is the real torchserve 0.12.0 wheel, which ``make test`` installs into
``.venv-torchserve-archiver`` (it needs no torch to install). Its sources are read with
``ast``, never imported: importing them would need torch, captum, vLLM and more in that venv.
Ours are imported as a handler imports them, through the shim the worker installs; a module
that TorchServe itself cannot import without an optional package (vLLM, DALI, ...) must fail
the same way here when that package is missing, and is then compared from its source.

What is compared, per module of the wheel (those in OUT_OF_SCOPE aside):

* every module-level function and class whose name does not start with ``_``, and every name
  a module assigns at its top level (also inside ``if``/``try``) or imports from ``ts`` (a
  handler may import ``create_predict_response`` from ``ts.handler_utils.utils``);
* every method of those classes: public ones, the ``_single_underscore`` ones (the hooks
  subclasses call or override, e.g. ``BaseHandler._load_pickled_model``), ``__init__`` and
  ``__call__``; properties by name; ``async`` where TorchServe's is;
* signatures: the same parameters in the same order, of the same kinds, with the same defaults
  (literal defaults by value). Ours may add parameters after TorchServe's when they have
  defaults (a call written for TorchServe still binds);
* base classes: where TorchServe's class derives from another of its classes (or a
  standard one such as ``threading.Thread``), ours derives from ours.

Each missing name and each mismatch is reported, all at once.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from backend.compat import SHIM_DIR, install_torchserve_shim
from tests.conftest import ROOT
from tests.unit.imports import forget_modules

SIDE_VENV = ROOT / ".venv-torchserve-archiver"

#: Parts of the wheel that are not a handler's API: TorchServe's own tests. (The helpers
#: of its handler tests, ``ts.torch_handler.unit_tests.test_utils`` and ``models``, are in
#: scope: its examples' tests import MockContext from there.)
_TORCHSERVE_TESTS = "TorchServe's own tests, shipped inside the wheel; no handler imports them"
OUT_OF_SCOPE: dict[str, str] = {
    "ts.torch_handler.unit_tests.conftest": _TORCHSERVE_TESTS,
    **{f"ts.torch_handler.unit_tests.{name}": _TORCHSERVE_TESTS for name in (
        "test_base_handler", "test_envelopes", "test_image_classifier", "test_image_segmenter",
        "test_mnist_kf", "test_object_detector")},
}

#: TorchServe's properties that are plain instance attributes of ours (set in ``__init__``),
#: which a handler reads and writes the same way.
INSTANCE_ATTRIBUTES: dict[str, str] = {
    "ts.context.Context.request_processor": "backend.context.Context sets it per batch",
}

#: Modules TorchServe imports an optional package for at import time: without the package,
#: importing ours must fail as TorchServe's does, naming the package (their names are then
#: compared from our source).
OPTIONAL_PACKAGES: dict[str, str] = {
    "ts.handler_utils.distributed.deepspeed": "deepspeed",
    "ts.handler_utils.distributed.pt_pippy": "pippy",
    "ts.torch_handler.distributed.base_pippy_handler": "pippy",
    "ts.handler_utils.hf_batch_streamer": "transformers",
    "ts.handler_utils.preprocess.dali": "nvidia.dali",
    "ts.handler_utils.preprocess.built-in.dali_pipeline_generation": "nvidia.dali",
    "ts.torch_handler.dali_handler": "nvidia.dali",
    "ts.torch_handler.dali_image_classifier": "nvidia.dali",
    "ts.torch_handler.trt_llm_handler": "tensorrt_llm",
    "ts.torch_handler.vllm_handler": "vllm",
    "ts.utils.hf_utils": "huggingface_hub",
    "ts.llm_launcher": "huggingface_hub",
}

NO_DEFAULT = "<no default>"
EXPRESSION = "<an expression>"


def wheel_root() -> Path | None:
    found = sorted(SIDE_VENV.glob("lib/python*/site-packages/ts/__init__.py"))
    return found[0].parent if found else None


pytestmark = pytest.mark.skipif(
    wheel_root() is None,
    reason="run `make test`: it installs torchserve==0.12.0 into .venv-torchserve-archiver")


# --- what a module offers, as data ------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    kind: inspect._ParameterKind
    default: Any = NO_DEFAULT


@dataclass
class Function:
    params: list[Param]
    is_async: bool = False


@dataclass
class Class:
    bases: list[str]
    methods: dict[str, Function] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)
    static: set[str] = field(default_factory=set)


@dataclass
class ModuleApi:
    functions: dict[str, Function] = field(default_factory=dict)
    classes: dict[str, Class] = field(default_factory=dict)
    variables: set[str] = field(default_factory=set)
    #: name -> the ts module it is imported from
    reexports: dict[str, str] = field(default_factory=dict)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def checked_method(name: str) -> bool:
    return name in ("__init__", "__call__") or not name.startswith("__")


def ast_default(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except ValueError:
        return EXPRESSION


def ast_params(args: ast.arguments) -> list[Param]:
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    params = [Param(arg.arg, inspect.Parameter.POSITIONAL_ONLY if index < len(args.posonlyargs)
                    else inspect.Parameter.POSITIONAL_OR_KEYWORD, ast_default(default))
              for index, (arg, default) in enumerate(zip(positional, defaults, strict=True))]
    if args.vararg:
        params.append(Param(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    params += [Param(arg.arg, inspect.Parameter.KEYWORD_ONLY, ast_default(default))
               for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        params.append(Param(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return params


def decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d) for d in node.decorator_list}


def top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those inside top-level ``if``/``try``/``with`` blocks too (not
    a script's ``if __name__ == "__main__":`` block)."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.If):
            yield from top_level_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from top_level_statements(
                node.body + node.orelse + node.finalbody
                + [s for handler in node.handlers for s in handler.body])
        elif isinstance(node, ast.With):
            yield from top_level_statements(node.body)


def read_source(path: Path, name: str) -> ModuleApi:
    """The API a module's source defines (TorchServe's, or ours when it cannot be imported)."""
    api = ModuleApi()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in top_level_statements(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                api.functions[node.name] = Function(
                    ast_params(node.args), isinstance(node, ast.AsyncFunctionDef))
        elif isinstance(node, ast.ClassDef):
            if not node.name.startswith("_"):
                api.classes[node.name] = read_class(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            api.variables |= {t.id for t in targets
                              if isinstance(t, ast.Name) and not t.id.startswith("_")}
        elif isinstance(node, ast.ImportFrom):
            origin = resolve_import(node, package)
            if origin is not None and (origin == "ts" or origin.startswith("ts.")):
                for alias in node.names:
                    public = alias.asname or alias.name
                    if not public.startswith("_"):
                        api.reexports[public] = origin
    return api


def resolve_import(node: ast.ImportFrom, package: str) -> str | None:
    if node.level == 0:
        return node.module
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def read_class(node: ast.ClassDef) -> Class:
    cls = Class([ast.unparse(base) for base in node.bases])
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not checked_method(item.name):
            continue
        decorators = decorator_names(item)
        if any(d.endswith((".setter", ".deleter")) for d in decorators):
            continue
        if "property" in decorators:
            cls.properties.add(item.name)
            continue
        params = ast_params(item.args)
        if "classmethod" in decorators:
            params = params[1:]
        if "staticmethod" in decorators:
            cls.static.add(item.name)
        cls.methods[item.name] = Function(params, isinstance(item, ast.AsyncFunctionDef))
    return cls


# --- comparing --------------------------------------------------------------------------------


def runtime_params(function: Any) -> list[Param]:
    return [Param(p.name, p.kind, NO_DEFAULT if p.default is inspect.Parameter.empty
                  else p.default)
            for p in inspect.signature(function).parameters.values()]


POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def default_problem(where: str, want: Param, have: Param) -> str | None:
    if (want.default == NO_DEFAULT) != (have.default == NO_DEFAULT) or (
            want.default not in (NO_DEFAULT, EXPRESSION) and have.default != EXPRESSION
            and want.default != have.default):
        return (f"{where}: parameter {want.name!r} defaults to {have.default!r}, "
                f"TorchServe's to {want.default!r}")
    return None


def signature_problems(where: str, theirs: Function, ours: list[Param],
                       ours_async: bool) -> list[str]:
    """Positional parameters: the same names, kinds and defaults in the same order, extra
    ones after them only with defaults; ``*args``/``**kwargs`` where TorchServe's has them;
    keyword-only ones by name, extra ones only with defaults."""
    problems = []
    if theirs.is_async != ours_async:
        problems.append(f"{where}: TorchServe's is {'' if theirs.is_async else 'not '}async")
    shown = ", ".join(p.name for p in theirs.params)
    want_positional = [p for p in theirs.params if p.kind in POSITIONAL]
    have_positional = [p for p in ours if p.kind in POSITIONAL]
    for want, have in zip(want_positional, have_positional, strict=False):
        if (want.name, want.kind) != (have.name, have.kind):
            problems.append(f"{where}: parameters ({', '.join(p.name for p in ours)}) differ "
                            f"from TorchServe's ({shown}) at {want.name!r} "
                            f"({want.kind.description} vs {have.name!r} "
                            f"{have.kind.description})")
            return problems
        problem = default_problem(where, want, have)
        if problem:
            problems.append(problem)
    if len(have_positional) < len(want_positional):
        problems.append(f"{where}: missing parameters "
                        f"{[p.name for p in want_positional[len(have_positional):]]} "
                        f"(TorchServe: {shown})")
    want_keyword = {p.name: p for p in theirs.params if p.kind == inspect.Parameter.KEYWORD_ONLY}
    have_keyword = {p.name: p for p in ours if p.kind == inspect.Parameter.KEYWORD_ONLY}
    for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        if any(p.kind == kind for p in theirs.params) and not any(p.kind == kind for p in ours):
            problems.append(f"{where}: no {kind.description} parameter (TorchServe: {shown})")
    for name, want in want_keyword.items():
        if name not in have_keyword:
            problems.append(f"{where}: missing keyword-only parameter {name!r}")
            continue
        problem = default_problem(where, want, have_keyword[name])
        if problem:
            problems.append(problem)
    extra = have_positional[len(want_positional):] + [
        p for name, p in have_keyword.items() if name not in want_keyword]
    for param in extra:
        if param.default == NO_DEFAULT:
            problems.append(f"{where}: extra parameter {param.name!r} has no default, so a "
                            f"call written for TorchServe ({shown}) fails")
    return problems


def excluded(qualified: str) -> bool:
    return any(qualified == prefix or qualified.startswith(prefix + ".")
               for prefix in OUT_OF_SCOPE)


def compare_runtime(name: str, theirs: ModuleApi, module: Any) -> list[str]:
    problems: list[str] = []
    for fname, function in theirs.functions.items():
        where = f"{name}.{fname}"
        ours = getattr(module, fname, None)
        if ours is None or not callable(ours):
            problems.append(f"{where}: missing function")
            continue
        problems += signature_problems(where, function, runtime_params(ours),
                                       inspect.iscoroutinefunction(ours))
    for cname, cls in theirs.classes.items():
        problems += compare_class(f"{name}.{cname}", cls, getattr(module, cname, None), module)
    for variable in sorted(theirs.variables):
        if not hasattr(module, variable) and not excluded(f"{name}.{variable}"):
            problems.append(f"{name}.{variable}: missing module-level name")
    for public, origin in sorted(theirs.reexports.items()):
        if excluded(origin) or excluded(f"{name}.{public}"):
            continue
        if not hasattr(module, public):
            problems.append(f"{name}.{public}: missing (TorchServe's module imports it from "
                            f"{origin}, so handlers can import it from here)")
    return problems


def compare_class(where: str, theirs: Class, ours: Any, module: Any) -> list[str]:
    if excluded(where):
        return []
    if not isinstance(ours, type):
        return [f"{where}: missing class"]
    problems = []
    for base in theirs.bases:
        if base in ("ABC", "abc.ABC", "object"):
            continue
        expected = resolve(module, base)
        if isinstance(expected, type) and not issubclass(ours, expected):
            problems.append(f"{where}: not a subclass of {base}")
    for method, function in theirs.methods.items():
        qualified = f"{where}.{method}"
        if excluded(qualified):
            continue
        static = inspect.getattr_static(ours, method, None)
        if static is None:
            problems.append(f"{qualified}: missing method")
            continue
        if method in theirs.static and not isinstance(static, staticmethod):
            problems.append(f"{qualified}: TorchServe's is a staticmethod")
        bound = getattr(ours, method)
        problems += signature_problems(qualified, function, runtime_params(bound),
                                       inspect.iscoroutinefunction(bound))
    for prop in sorted(theirs.properties):
        qualified = f"{where}.{prop}"
        if excluded(qualified) or qualified in INSTANCE_ATTRIBUTES:
            continue
        if not hasattr(inspect.getattr_static(ours, prop, None), "__get__"):
            problems.append(f"{qualified}: missing property")
    return problems


def resolve(module: Any, dotted: str) -> Any:
    """What ``dotted`` names in ``module``'s namespace (``threading.Thread``), else a builtin
    (``Exception``); None when neither has it."""
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return getattr(builtins, dotted, None)
    return value


def compare_source(name: str, theirs: ModuleApi, ours: ModuleApi) -> list[str]:
    problems: list[str] = []
    for fname, function in theirs.functions.items():
        if fname not in ours.functions:
            problems.append(f"{name}.{fname}: missing function")
            continue
        have = ours.functions[fname]
        problems += signature_problems(f"{name}.{fname}", function, have.params, have.is_async)
    for cname, cls in theirs.classes.items():
        where = f"{name}.{cname}"
        mine = ours.classes.get(cname)
        if mine is None:
            problems.append(f"{where}: missing class")
            continue
        for method, function in cls.methods.items():
            have_method = mine.methods.get(method)
            if have_method is None:
                problems.append(f"{where}.{method}: missing method (in its own source)")
                continue
            problems += signature_problems(f"{where}.{method}", function, have_method.params,
                                           have_method.is_async)
    for variable in sorted(theirs.variables - ours.variables - set(ours.reexports)):
        problems.append(f"{name}.{variable}: missing module-level name")
    for public in sorted(set(theirs.reexports) - set(ours.reexports) - ours.variables
                         - set(ours.functions) - set(ours.classes)):
        if not excluded(theirs.reexports[public]):
            problems.append(f"{name}.{public}: missing (imported from "
                            f"{theirs.reexports[public]} in TorchServe)")
    return problems


# --- the test -----------------------------------------------------------------------------------


@pytest.fixture
def ts_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    if not install_torchserve_shim():
        pytest.skip("a real TorchServe `ts` package is installed; the shim stays unused")
    yield
    forget_modules(tmp_path, "ts")


def wheel_modules() -> list[tuple[str, Path]]:
    root = wheel_root()
    assert root is not None
    found = [(module_name(root, path), path) for path in sorted(root.rglob("*.py"))]
    return [(name, path) for name, path in found if not excluded(name)]


def our_source(name: str) -> Path:
    relative = Path(*name.split("."))
    for candidate in (SHIM_DIR / relative.with_suffix(".py"), SHIM_DIR / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(relative)


def test_every_public_name_of_torchserve_ts_is_in_ours(ts_shim: None) -> None:
    problems: list[str] = []
    modules = wheel_modules()
    assert len(modules) > 50, "the wheel's ts package looks incomplete"
    for name, path in modules:
        theirs = read_source(path, name)
        optional = OPTIONAL_PACKAGES.get(name)
        if optional is not None and not installed(optional):
            problems += optional_import_problems(name, optional)
            try:
                problems += compare_source(name, theirs, read_source(our_source(name), name))
            except FileNotFoundError:
                problems.append(f"{name}: missing module")
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            problems.append(f"{name}: missing module ({exc})")
            continue
        except Exception as exc:
            problems.append(f"{name}: importing it fails: {type(exc).__name__}: {exc}")
            continue
        problems += compare_runtime(name, theirs, module)
    assert not problems, f"{len(problems)} differences from TorchServe 0.12's ts:\n" + \
        "\n".join(problems)


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def optional_import_problems(name: str, package: str) -> list[str]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing != package.split(".")[0] or package not in str(exc):
            return [f"{name}: importing it without {package} fails without naming it: {exc}"]
        return []
    except Exception as exc:
        return [f"{name}: without {package}, import fails with {type(exc).__name__} (TorchServe: "
                f"ModuleNotFoundError): {exc}"]
    return [f"{name}: imports without {package}, which TorchServe's cannot"]


def test_the_comparison_catches_what_is_missing_or_different(tmp_path: Path) -> None:
    """The comparer itself: a missing function, class member or re-export, a renamed
    parameter, a changed default, an extra required parameter and a lost base class are each
    reported; an extra optional parameter is not."""
    source = tmp_path / "fake.py"
    source.write_text(
        "from ts.context import Context\n"
        "class Base: ...\n"
        "class Handler(Base):\n"
        "    def handle(self, data, context): ...\n"
        "    def _hook(self, x=1): ...\n"
        "    async def run(self): ...\n"
        "def helper(a, b=2, *args, **kw): ...\n"
        "def strict(a): ...\n"
        "def gone(): ...\n"
        "LIMIT = 3\n", encoding="utf-8")
    theirs = read_source(source, "fake")

    class Base:
        pass

    class Handler:
        def handle(self, data: Any, ctx: Any) -> None: ...

        def _hook(self, x: int = 2) -> None: ...

        def run(self) -> None: ...

    def helper(a: Any, b: int = 2, *args: Any, more: int = 0, **kw: Any) -> None: ...

    def strict(a: Any, b: Any) -> None: ...

    module = type(sys)("fake")
    module.__dict__.update(Base=Base, Handler=Handler, helper=helper, strict=strict)

    problems = compare_runtime("fake", theirs, module)

    assert problems == [
        "fake.strict: extra parameter 'b' has no default, so a call written for TorchServe "
        "(a) fails",
        "fake.gone: missing function",
        "fake.Handler: not a subclass of Base",
        "fake.Handler.handle: parameters (self, data, ctx) differ from TorchServe's "
        "(self, data, context) at 'context' (positional or keyword vs 'ctx' positional or "
        "keyword)",
        "fake.Handler._hook: parameter 'x' defaults to 2, TorchServe's to 1",
        "fake.Handler.run: TorchServe's is async",
        "fake.LIMIT: missing module-level name",
        "fake.Context: missing (TorchServe's module imports it from ts.context, so handlers "
        "can import it from here)",
    ]
