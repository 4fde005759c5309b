"""No test compares torch's and onnxruntime's results bit for bit by hand. The bits of a float sum follow
the order a library's kernels add in, and each library picks its kernels by the CPU's features
(onnxruntime's MLAS whatever ATEN_CPU_CAPABILITY says), so such a comparison holds on the CPU it was
written on and fails on another. An exact comparison of the two goes through lift_helpers.assert_same,
which first proves every sum on its path exact on its data, or is listed in EXACT_BECAUSE with why no
sum decides its bits. Read from the test sources, so a new one fails here at once, on any CPU."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from finetune.lift import lift_model

from .lift_helpers import assert_same, grid_step, inexact_nodes, onnx_model, tensor

TESTS = Path(__file__).parent
Sources = dict[str, tuple[list[str], set[str]]]  # a function's name -> its parameters and what its return carries
ONNXRUNTIME, TORCH = "onnxruntime", "torch"
# Calls whose value comes from a library (tests' own helpers that call them are found from their returns).
SOURCES = {"inference_session": ONNXRUNTIME, "InferenceSession": ONNXRUNTIME, "onnxruntime_values": ONNXRUNTIME,
           "lift_model": TORCH, "run_torch": TORCH}
# Bit-for-bit comparisons by name (torch.equal is read apart: np.equal compares element-wise).
EXACT_CALLS = {"array_equal", "array_equiv", "assert_array_equal"}
TOLERANCE_CALLS = {"assert_allclose", "assert_close", "allclose", "isclose"}
# The comparisons of both libraries' values that are exact on any CPU, by file::function, and why.
EXACT_BECAUSE = {
    "test_lift_qdq.py::test_dequantized_weight_is_a_parameter_with_identical_numerics":
        "a weight DequantizeLinear's output: (codes - zero point) * scale, one rounding, no sum",
    "test_lift_qdq.py::test_extended_dequantize_of_uint16_weight":
        "a weight DequantizeLinear's output: (codes - zero point) * scale, one rounding, no sum",
    "test_lift_quantized.py::assert_quantizers_exact":
        "one quantizer alone, fed onnxruntime's own input value: element-wise, no sum",
    "test_decoders.py::test_the_float_decoder_lifts_to_onnxruntimes_logits_and_greedy_tokens":
        "greedy tokens: each step's top logit leads by over twice the rounding bound, asserted first",
    "test_smollm2.py::test_the_truncated_model_lifts_to_onnxruntimes_logits_and_greedy_tokens":
        "greedy tokens: each step's top logit leads by over twice the rounding bound, asserted first",
    "test_smollm2.py::test_the_whole_model_answers_and_its_export_decodes_as_torch_does":
        "greedy tokens: each step's top logit leads by over twice the rounding bound, asserted",
}


@dataclass
class Scope:
    """What one function's names hold: the libraries (or the function's own parameters) they come from."""
    name: str
    params: list[str]
    labels: dict[str, set[str]] = field(default_factory=dict)


@functools.cache
def assigned(node: ast.FunctionDef) -> list[tuple[list[str], ast.AST]]:
    """(names bound, value) of every binding in a function: assignments, loops, with-items, comprehensions."""
    pairs: list[tuple[ast.AST, ast.AST]] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            pairs += [(target, sub.value) for target in sub.targets]
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and sub.value is not None:
            pairs.append((sub.target, sub.value))
        elif isinstance(sub, (ast.For, ast.comprehension)):
            pairs.append((sub.target, sub.iter))
        elif isinstance(sub, ast.withitem) and sub.optional_vars is not None:
            pairs.append((sub.optional_vars, sub.context_expr))
        elif isinstance(sub, ast.FunctionDef) and sub is not node:  # a closure carries what its body reads
            pairs.append((ast.Name(sub.name), sub))
    return [([n.id for n in ast.walk(target) if isinstance(n, ast.Name)], value)
            for pair in pairs for target, value in unpacked(*pair)]


def unpacked(target: ast.AST, value: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """`a, b = x, y` as a = x and b = y (any other binding as it stands)."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) and len(target.elts) == len(value.elts):
        return [pair for t, v in zip(target.elts, value.elts) for pair in unpacked(t, v)]
    return [(target, value)]


def call_name(call: ast.Call) -> str:
    """The called function's own name (the last attribute of a dotted one)."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def labels_of(expr: ast.AST | None, scope: Scope, sources: Sources) -> set[str]:
    """The libraries (and parameters, as 'param:name') an expression's value may come from: a known
    function's call what its return carries (its parameters' part from the arguments bound to them),
    any other call or expression all that flows into it."""
    if expr is None:
        return set()
    if isinstance(expr, ast.Name):
        return set(scope.labels.get(expr.id, ()))
    if isinstance(expr, ast.Call) and call_name(expr) in sources and (isinstance(expr.func, ast.Name) or call_name(expr) in SOURCES):
        params, labels = sources[call_name(expr)]
        return own_labels(labels) | handed(params, labels, expr, scope, sources)
    return set().union(*(labels_of(child, scope, sources) for child in ast.iter_child_nodes(expr)))


def own_labels(labels: set[str]) -> set[str]:
    """The libraries among labels (not the parameters)."""
    return {label for label in labels if not label.startswith("param:")}


def handed(params: list[str], labels: set[str], call: ast.Call, scope: Scope, sources: Sources) -> set[str]:
    """The labels of the arguments a call binds to the parameters named in `labels`."""
    named = {label[len("param:"):] for label in labels if label.startswith("param:")}
    bound = [*zip(params, call.args), *((k.arg, k.value) for k in call.keywords)]
    return set().union(*(labels_of(arg, scope, sources) for name, arg in bound if name in named))


def label_scope(function: ast.FunctionDef, sources: Sources) -> Scope:
    """A function's names labelled by what flows into them, to a fixed point (order is ignored: a name
    bound twice holds both values' labels)."""
    params = [a.arg for a in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]]
    scope = Scope(function.name, params, {p: {f"param:{p}"} for p in params})
    pairs = assigned(function)
    changed = True
    while changed:
        changed = False
        for names, value in pairs:
            new = labels_of(value, scope, sources)
            for name in names:
                if not new <= scope.labels.setdefault(name, set()):
                    scope.labels[name] |= new
                    changed = True
    return scope


def exact_operands(node: ast.AST, asserted: set[int]) -> list[ast.AST] | None:
    """The compared values where a node compares bit for bit, else None (an equality counts where it is
    asserted, alone or joined by `and`, not where a test counts how many are equal)."""
    if isinstance(node, ast.Call):
        name = call_name(node)
        zero = {k.arg for k in node.keywords if isinstance(k.value, ast.Constant) and k.value.value == 0}
        torch_equal = name == "equal" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "torch"
        if name in EXACT_CALLS or torch_equal or (name in TOLERANCE_CALLS and {"atol", "rtol"} <= zero):
            return node.args[:2]
    if id(node) in asserted and isinstance(node, ast.Compare) and all(isinstance(o, ast.Eq) for o in node.ops):
        return [operand for operand in (node.left, *node.comparators) if not is_metadata(operand)]
    return None


def is_metadata(expr: ast.AST) -> bool:
    """Whether an expression reads what a value is rather than its bits: a length, a shape, a type, a
    comparison's truth."""
    return (isinstance(expr, ast.Call) and call_name(expr) in ("len", "type", "isinstance")) or \
        (isinstance(expr, ast.Attribute) and expr.attr in ("shape", "dtype", "ndim", "size")) or \
        isinstance(expr, (ast.Compare, ast.BoolOp))


@dataclass
class Finding:
    """A comparison of both libraries' values, bit for bit: where it stands, and the EXACT_BECAUSE key
    (the function comparing, or the helper it hands both values to)."""
    key: str
    line: int
    text: str


@functools.cache
def own_nodes(function: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of a function's body but those of the functions defined inside it."""
    found, stack = [], list(function.body)
    while stack:
        node = stack.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node)
            stack.extend(ast.iter_child_nodes(node))
    return found


@functools.cache
def functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Every function of a module, nested ones too."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]


def imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """The names a test module takes from its sibling modules (`from .x import a as b`): b -> (x.py, a)."""
    return {alias.asname or alias.name: (f"{node.module}.py", alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module for alias in node.names}


def resolve(tables: dict[str, dict], file: str, imports: dict[str, dict[str, tuple[str, str]]]) -> dict:
    """A per-file table (function name -> fact) seen from `file`: its own entries and those it imports."""
    seen = {alias: tables.get(module, {}).get(name) for alias, (module, name) in imports[file].items()}
    return {**{k: v for k, v in seen.items() if v is not None}, **tables.get(file, {})}


def scan(paths: list[Path], allowed: frozenset[str] = frozenset()) -> list[Finding]:
    """Every bit-for-bit comparison of onnxruntime's and torch's values in these test modules: made in a
    function, or by a helper that compares its parameters (a helper handing them on to one is one too,
    unless the one it hands them to is `allowed`) called with both libraries' values."""
    trees = {path.name: ast.parse(path.read_text()) for path in paths}
    imports = {file: imported_names(tree) for file, tree in trees.items()}
    labelled = scopes(trees, imports, function_returns(trees, imports))
    findings, comparers = [], {}
    for file, function, scope, sources in labelled:
        asserted = {id(test) for node in own_nodes(function) if isinstance(node, ast.Assert) for test in
                    (node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else [node.test])}
        for node in own_nodes(function):
            operands = exact_operands(node, asserted)
            labels = set().union(*(labels_of(o, scope, sources) for o in operands or ()))
            if {ONNXRUNTIME, TORCH} <= labels:
                findings.append(Finding(f"{file}::{function.name}", node.lineno, ast.unparse(node)[:120]))
            elif operands and labels != own_labels(labels):
                comparers.setdefault(file, {})[function.name] = (f"{file}::{function.name}", scope.params, labels)
    return findings + handed_to_comparers(labelled, imports, comparers, allowed)


def handed_to_comparers(labelled: list[tuple[str, ast.FunctionDef, Scope, Sources]], imports: dict[str, dict[str, tuple[str, str]]],
                        comparers: dict[str, dict[str, tuple[str, list[str], set[str]]]], allowed: frozenset[str]) -> list[Finding]:
    """The calls handing both libraries' values to a comparing helper, found once the helpers that hand
    their parameters on to one are known too."""
    while True:
        findings, grown = [], False
        for file, function, scope, sources in labelled:
            known = resolve(comparers, file, imports)
            for call in (n for n in own_nodes(function) if isinstance(n, ast.Call) and call_name(n) in known):
                key, params, labels = known[call_name(call)]
                carried = own_labels(labels) | handed(params, labels, call, scope, sources)
                if {ONNXRUNTIME, TORCH} <= carried:
                    findings.append(Finding(key, call.lineno, ast.unparse(call)[:120]))
                elif key not in allowed and carried != own_labels(carried) and function.name not in comparers.get(file, {}):
                    comparers.setdefault(file, {})[function.name] = (f"{file}::{function.name}", scope.params, carried)
                    grown = True
        if not grown:
            return findings


def seen_from(file: str, imports: dict[str, dict[str, tuple[str, str]]], returns: dict[str, Sources]) -> Sources:
    """The functions whose returns are known, as `file` names them: the library calls and the tests' own."""
    return {**resolve(returns, file, imports), **{name: ([], {library}) for name, library in SOURCES.items()}}


def function_returns(trees: dict[str, ast.Module], imports: dict[str, dict[str, tuple[str, str]]]) -> dict[str, Sources]:
    """What every test function's return carries, by file and name, to a fixed point (helpers return
    helpers' values)."""
    returns: dict[str, Sources] = {}
    for _ in range(10):
        before = repr(returns)
        for file, function, scope, sources in scopes(trees, imports, returns, returning=True):
            carried = [labels_of(n.value, scope, sources) for n in own_nodes(function) if isinstance(n, ast.Return)]
            returns.setdefault(file, {})[function.name] = (scope.params, set().union(*carried))
        if repr(returns) == before:
            return returns
    raise AssertionError("the returns' labels did not settle in 10 rounds")


def scopes(trees: dict[str, ast.Module], imports: dict[str, dict[str, tuple[str, str]]], returns: dict[str, Sources],
           returning: bool = False) -> list[tuple[str, ast.FunctionDef, Scope, Sources]]:
    """Every function of the test modules (or those returning a value), with its labelled names and the
    known functions it sees."""
    found = []
    for file, tree in trees.items():
        sources = seen_from(file, imports, returns)
        found += [(file, function, label_scope(function, sources), sources) for function in functions(tree)
                  if not returning or any(isinstance(n, ast.Return) and n.value for n in own_nodes(function))]
    return found


def test_no_test_compares_both_libraries_bit_for_bit_by_hand() -> None:
    """Every hand-made exact comparison of onnxruntime's and torch's values is one EXACT_BECAUSE explains,
    and each entry there still stands for one."""
    findings = scan(sorted(TESTS.glob("*.py")), frozenset(EXACT_BECAUSE))
    unexplained = [f"{f.key}:{f.line}: {f.text}" for f in findings if f.key not in EXACT_BECAUSE]
    assert not unexplained, ("bit-for-bit comparisons of onnxruntime's and torch's values, whose float sums each orders "
                             "its own way: use assert_same (it proves the sums exact) or assert the bound the numerics "
                             "give, or say in EXACT_BECAUSE why no sum is in play:\n" + "\n".join(unexplained))
    assert {f.key for f in findings} == set(EXACT_BECAUSE)


SEEDED_HELPERS = '''
def ours(model, x):
    return inference_session(model).run(None, {"x": x})[0]

def same(a, b):
    assert np.array_equal(a, b)

def same_rows(a, b):
    same(a[0], b[0])
'''
SEEDED_TESTS = '''
from .helpers import ours, same, same_rows

def test_direct(model, x):
    assert np.array_equal(run_torch(lift_model(model), [x])[0], ours(model, x))

def test_through_names_and_a_loop(model, x):
    module = lift_model(model)
    expected, actual = ours(model, x), module(torch.from_numpy(x))
    for e, a in zip([expected], [actual]):
        torch.testing.assert_close(a, e, atol=0, rtol=0)

def test_bytes(model, x):
    lifted, expected = run_torch(lift_model(model), [x])[0], ours(model, x)
    assert lifted.shape == expected.shape and lifted.tobytes() == expected.tobytes()

def test_handed_to_helpers(model, x):
    same(ours(model, x), run_torch(lift_model(model), [x])[0])
    same_rows(ours(model, x), run_torch(lift_model(model), [x])[0])

def test_within_a_bound_or_within_one_library(model, x):
    lifted, expected = run_torch(lift_model(model), [x])[0], ours(model, x)
    np.testing.assert_allclose(lifted, expected, atol=1e-5, rtol=0)
    assert (lifted.argmax(1) == expected.argmax(1)).mean() > 0.9 and len(lifted) == len(expected)
    assert np.array_equal(ours(model, x), ours(model, x)) and torch.equal(lift_model(model)(x), lift_model(model)(x))
    same(ours(model, x), ours(model, x))
'''


def test_the_scan_finds_each_way_of_comparing_both_libraries(tmp_path: Path) -> None:
    """Seeded comparisons: direct, through names, tuples and loops, of bytes, inside helpers (and helpers
    of helpers); bounded ones, counts and comparisons within one library are not found."""
    (tmp_path / "helpers.py").write_text(SEEDED_HELPERS)
    (tmp_path / "test_seeded.py").write_text(SEEDED_TESTS)
    found = sorted((f.key, f.line) for f in scan(sorted(tmp_path.glob("*.py"))))
    assert found == [("helpers.py::same", 18), ("helpers.py::same_rows", 19), ("test_seeded.py::test_bytes", 15),
                     ("test_seeded.py::test_direct", 5), ("test_seeded.py::test_through_names_and_a_loop", 11)]
    explained = sorted((f.key, f.line) for f in scan(sorted(tmp_path.glob("*.py")), frozenset({"helpers.py::same"})))
    assert explained == [found[0], *found[2:]]  # same_rows hands its values on to `same`, which is explained


def matmul(weight: np.ndarray) -> onnx.ModelProto:
    """x [2, K] @ weight."""
    k, n = weight.shape
    return onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", [2, k])],
                      [tensor("y", [2, n])], {"w": weight})


def test_assert_same_proves_a_sum_exact_or_refuses_to_compare_it_exactly() -> None:
    """Terms on one power-of-two grid whose magnitudes add up to under 2**24 steps: exact in any order, so
    compared bit for bit; float terms, a sum past 2**24 steps, a mean over 9, an approximated function: refused."""
    rng = np.random.default_rng(0)
    on_grid = (rng.integers(-8, 9, (2, 16)) / 8).astype(np.float32), (rng.integers(-100, 101, (16, 4)) / 32).astype(np.float32)
    assert grid_step(on_grid[1]) == 1 / 32 and inexact_nodes(matmul(on_grid[1]), [on_grid[0]]) == []
    assert_same(matmul(on_grid[1]), lift_model(matmul(on_grid[1])), [on_grid[0]])
    floats = rng.standard_normal((16, 4)).astype(np.float32)
    assert inexact_nodes(matmul(floats), [on_grid[0]])[0].startswith("mm (MatMul): terms on a grid of")
    with pytest.raises(AssertionError, match="through float sums each library orders its own way"):
        assert_same(matmul(floats), lift_model(matmul(floats)), [on_grid[0]])
    large = on_grid[1].copy()
    large[0, 0] = 2.0**20  # products on a grid of 1/256 as large as 2**20: 2**28 steps, past 2**24
    assert inexact_nodes(matmul(large), [on_grid[0]])[0].startswith("mm (MatMul): terms on a grid of 0.00390625")
    pooled = onnx_model([helper.make_node("GlobalAveragePool", ["x"], ["y"], name="pool")], [tensor("x", [1, 1, 3, 3])],
                        [tensor("y", [1, 1, 1, 1])])
    assert inexact_nodes(pooled, [np.ones((1, 1, 3, 3), np.float32)]) == ["pool: GlobalAveragePool is not read as an exact sum here"]
    tanh = onnx_model([helper.make_node("Tanh", ["x"], ["y"])], [tensor("x", [2])], [tensor("y", [2])])
    assert inexact_nodes(tanh, [np.zeros(2, np.float32)]) == ["Tanh: an approximation each library computes its own way"]
