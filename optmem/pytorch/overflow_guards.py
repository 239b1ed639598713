"""HuggingFace's overflow guard, held as one graph whichever side the sample takes.

DETR's family (DETR, Conditional DETR, Deformable DETR, RT-DETR, RT-DETRv2) and
Mask2Former's pixel decoder end each encoder layer's training forward with::

    if not torch.isfinite(hidden_states).all():
        clamp_value = torch.finfo(hidden_states.dtype).max - 1000
        hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)

a branch on an intermediate value, which optmem refuses
(:class:`~optmem.pytorch.branches.IntermediateBranch`): its assertion would run mid-step.
Where ``clamp_value`` equals the dtype's largest value (float32, bfloat16, float64: 1000
is below half an ulp there), the clamp leaves every finite value as it is, bit for bit,
and maps ``±inf`` to ``±max`` and NaN to NaN as the model's clamping side does: always
clamping is the model's computation on both sides, forward and backward (the clamp's
gradient is the incoming one wherever ``-max <= h <= max``, every finite value).
In float16 ``clamp_value`` is 64504 (rounded to 64512): the clamp changes 62 finite
values, and the guard stays refused.

:func:`overflow_guards` rewrites the guard so: the export with the sample's values took
one side; on the finite side the graph gets the clamp, on the clamping side it has it
already; either way the assertion goes. Only the exact pattern is recognised, checked in
the graph (the flag ``isfinite -> all -> item`` feeds nothing but the assertions, which
say which side was taken) and in the model's source, parsed at the line the graph names
(the ``if`` holds just those two statements, the bound is ``finfo(X.dtype).max - K``,
and no other name holds the guarded tensor: the last statement before the guard that
touches ``X`` assigns it a fresh value). Anything else is left as it is, refused.

The clamp held is ``optmem::overflow_clamp`` (stop 87), not ``aten.clamp``: its values
are the clamp's, and so is its gradient on the clamping side, but on the finite side the
model has no clamp, and autograd passes the gradient on in its own layout, where
``aten.clamp``'s backward (``where(-c <= h <= c, grad, 0)``) returns it in ``h``'s. Equal
values, other strides: a later reduction summed them in another order (HF Table
Transformer, whose guarded value is a transposed view: its ``input_projection.bias``
gradient was 1.2e-7 off). The op's backward decides at run time, as the model does:
every value of ``h`` within the bound, the gradient as it came (a copy in its layout);
else ``aten.clamp``'s gradient, bit for bit.
"""

from __future__ import annotations

import ast
import functools
import linecache
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from optmem.pytorch.branches import target_name

__all__ = ["OVERFLOW_CLAMP", "overflow_guards"]


@torch.library.custom_op("optmem::overflow_clamp", mutates_args=())
def _overflow_clamp(h: torch.Tensor, bound: float) -> torch.Tensor:
    """``torch.clamp(h, -bound, bound)``: the guard's clamp held unconditionally."""
    return torch.clamp(h, min=-bound, max=bound)


@_overflow_clamp.register_fake
def _overflow_clamp_fake(h: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("optmem::overflow_clamp_backward", mutates_args=())
def _overflow_clamp_backward(grad: torch.Tensor, h: torch.Tensor, bound: float
                             ) -> torch.Tensor:
    """The gradient of :func:`_overflow_clamp`, as the model's side of the guard gives it.

    Every value of ``h`` within ``[-bound, bound]`` (the model did not clamp): ``grad``
    itself, copied in its own layout (an operator cannot return its input). Else
    ``aten.clamp``'s backward, ``where(h >= -bound & h <= bound, grad, 0)``, bit for bit
    and in its layout (``h``'s).
    """
    inside = (h >= -bound).logical_and_(h <= bound)
    if bool(inside.all()):
        return grad.clone()
    return torch.where(inside, grad, torch.scalar_tensor(0.0, dtype=grad.dtype,
                                                         device=grad.device))


@_overflow_clamp_backward.register_fake
def _overflow_clamp_backward_fake(grad: torch.Tensor, h: torch.Tensor, bound: float
                                  ) -> torch.Tensor:
    return torch.empty_like(grad)


def _clamp_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.bound = inputs[1]


def _clamp_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (h,) = ctx.saved_tensors
    return OVERFLOW_CLAMP_BACKWARD(grad, h, ctx.bound), None


def _backward_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    """The backward is linear in ``grad`` (a double backward): the same op on ``grad``."""
    (h,) = ctx.saved_tensors
    return OVERFLOW_CLAMP_BACKWARD(grad, h, ctx.bound), None, None


def _backward_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.bound = inputs[2]


_overflow_clamp.register_autograd(_clamp_grad, setup_context=_clamp_setup)
_overflow_clamp_backward.register_autograd(_backward_grad, setup_context=_backward_setup)

OVERFLOW_CLAMP = torch.ops.optmem.overflow_clamp.default
OVERFLOW_CLAMP_BACKWARD = torch.ops.optmem.overflow_clamp_backward.default

_SCALAR_STEPS = {"sym_ite": torch.sym_ite, "sym_not": torch.sym_not, "eq": operator.eq,
                 "ne": operator.ne, "le": operator.le, "ge": operator.ge, "lt": operator.lt,
                 "gt": operator.gt}
_ASSERT = "_assert_scalar"


@dataclass(frozen=True)
class _Guard:
    """A recognised guard: its value, its flag's nodes, the side taken and the bound."""

    value: fx.Node
    flag: tuple[fx.Node, ...]  # isfinite ... _assert_scalar, in graph order
    finite: bool  # the side the export took: every value finite (no clamp in the graph)
    bound: float
    taken: fx.Node | None  # the clamping side's clamp (``None`` on the finite side)


def overflow_guards(gm: fx.GraphModule) -> int:
    """Hold each HuggingFace overflow guard of ``gm`` as an unconditional clamp.

    Returns the number of guards rewritten; their assertions are gone, the clamp is in
    the graph (inserted on the finite side, kept on the clamping side).
    """
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    guards = [g for n in list(gm.graph.nodes)
              if (g := _recognised(n, order)) is not None]
    for guard in guards:
        _rewrite(gm, guard, order)
    if guards:
        gm.recompile()
    return len(guards)


def _recognised(node: fx.Node, order: dict[fx.Node, int]) -> _Guard | None:
    """``node``'s guard if ``node`` is the ``isfinite`` of the exact pattern, else ``None``."""
    if node.op != "call_function" or target_name(node) != "isfinite":
        return None
    value = node.args[0]
    dtype = getattr(value.meta.get("val"), "dtype", None) if isinstance(value, fx.Node) else None
    if not isinstance(value, fx.Node) or dtype is None or not dtype.is_floating_point:
        return None
    item = _flag_read(node)
    steps = _scalar_steps(item) if item is not None else None
    if item is None or steps is None:
        return None
    finite = _side_taken(item, steps)
    written = _guard_in_source(node)
    if finite is None or written is None:
        return None
    bound = torch.finfo(dtype).max - written
    if bound != torch.finfo(dtype).max:  # float16: the clamp would change finite values
        return None
    flag = tuple(sorted({node, *_between(node, item), item, *steps}, key=order.__getitem__))
    taken = None if finite else _taken_clamp(value, bound, order[flag[-1]], order)
    if not finite and taken is None:
        return None
    return _Guard(value, flag, finite, bound, taken)


def _flag_read(isfinite: fx.Node) -> fx.Node | None:
    """The ``item`` reading ``isfinite(h).all()`` (through ``ne(·, 0)``), if nothing else does."""
    node = _only_user(isfinite)
    if node is None or target_name(node) != "all":
        return None
    read = _only_user(node)
    if read is not None and target_name(read) == "ne" and read.args[1:] == (0,):
        read = _only_user(read)
    if read is None or target_name(read) not in ("item", "_local_scalar_dense"):
        return None
    return read


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].op == "call_function" else None


def _between(isfinite: fx.Node, item: fx.Node) -> list[fx.Node]:
    """The nodes strictly between ``isfinite`` and ``item`` (``all``, maybe ``ne``)."""
    found: list[fx.Node] = []
    node = item.args[0]
    while isinstance(node, fx.Node) and node is not isfinite:
        found.append(node)
        node = node.args[0]
    return found


def _scalar_steps(item: fx.Node) -> list[fx.Node] | None:
    """What reads ``item``: symbolic steps ending in assertions only, or ``None``."""
    found: list[fx.Node] = []
    stack = list(item.users)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        name = target_name(node)
        if node.op != "call_function" or (name not in _SCALAR_STEPS and name != _ASSERT):
            return None
        found.append(node)
        stack.extend(node.users)
    return found if any(target_name(n) == _ASSERT for n in found) else None


def _side_taken(item: fx.Node, steps: list[fx.Node]) -> bool | None:
    """The flag's value (every value finite) under which all assertions hold, if one only."""
    holding = [flag for flag in (True, False) if _asserts_hold(item, steps, flag)]
    return holding[0] if len(holding) == 1 else None


def _asserts_hold(item: fx.Node, steps: list[fx.Node], flag: bool) -> bool:
    """Whether every assertion in ``steps`` holds when ``item`` reads ``flag``."""
    values: dict[fx.Node, object] = {item: flag}
    pending = list(steps)
    while pending:
        ready = [n for n in pending if all(a in values for a in n.all_input_nodes)]
        if not ready:
            return False
        for node in ready:
            pending.remove(node)
            args = [values[a] if isinstance(a, fx.Node) else a for a in node.args]
            if target_name(node) == _ASSERT:
                if not args[0]:
                    return False
                values[node] = None
            else:
                step: Any = _SCALAR_STEPS[target_name(node)]
                values[node] = step(*args)
    return True


def _taken_clamp(value: fx.Node, bound: float, last: int, order: dict[fx.Node, int]
                 ) -> fx.Node | None:
    """The clamp the clamping side put in the graph: ``clamp(h, -bound, bound)`` after it."""
    for user in value.users:
        if (target_name(user) == "clamp" and order.get(user, -1) > last and not user.kwargs
                and user.args == (value, -bound, bound)):
            return user
    return None


def _rewrite(gm: fx.GraphModule, guard: _Guard, order: dict[fx.Node, int]) -> None:
    """Drop the guard's assertions; what reads the value after reads the held clamp.

    On the finite side the clamp is inserted after the guard; on the clamping side the
    graph's ``aten.clamp`` is replaced: either way by :data:`OVERFLOW_CLAMP`, whose
    gradient follows the side taken at run time.
    """
    last, taken = guard.flag[-1], guard.taken
    readers = ([u for u in guard.value.users
                if u not in guard.flag and order.get(u, -1) > order[last]]
               if taken is None else list(taken.users))
    with gm.graph.inserting_after(last if taken is None else taken):
        clamp = gm.graph.call_function(OVERFLOW_CLAMP, (guard.value, guard.bound))
    meta = guard.flag[0].meta if taken is None else taken.meta
    clamp.meta = {**guard.value.meta, **{k: v for k, v in meta.items()
                                         if k in ("nn_module_stack", "stack_trace")}}
    for reader in readers:
        reader.replace_input_with(taken if taken is not None else guard.value, clamp)
    if taken is not None:
        gm.graph.erase_node(taken)
    for node in reversed(guard.flag):
        gm.graph.erase_node(node)


# ------------------------------------------------------------------ the model's source
def _guard_in_source(isfinite: fx.Node) -> float | None:
    """``K`` of the exact guard at the model's line that made ``isfinite``, else ``None``."""
    where = _innermost_frame(isfinite.meta.get("stack_trace") or "")
    if where is None:
        return None
    tree = _parsed(where[0])
    if tree is None:
        return None
    return _guard_at(tree, where[1])


def _innermost_frame(trace: str) -> tuple[str, int] | None:
    """``(path, line)`` of the last ``File "...", line N`` of a stack trace."""
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "'):].partition('", line ')
            number = rest.split(",")[0]
            return (path, int(number)) if number.isdigit() else None
    return None


@functools.lru_cache(maxsize=64)
def _parsed(path: str) -> ast.Module | None:
    """The parsed source of ``path`` (as ``linecache`` holds it), or ``None``."""
    source = "".join(linecache.getlines(path))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _guard_at(tree: ast.Module, line: int) -> float | None:
    """``K`` if the ``if`` at ``line`` is the exact guard on a fresh name, else ``None``."""
    for block, index in _blocks(tree):
        guard = _if_at(block[index], line)
        if guard is not None:
            name, offset = _exact_guard(guard)
            if name is None or offset is None:
                return None
            return offset if _fresh_before(block, index, name) else None
    return None


def _if_at(stmt: ast.stmt, line: int) -> ast.If | None:
    """The ``if`` at ``line``: ``stmt`` itself, or the one statement of ``stmt``'s body.

    The second is HF's ``if self.training:`` around the guard; the guarded name's
    freshness is then read before ``stmt``.
    """
    if not isinstance(stmt, ast.If):
        return None
    if stmt.lineno == line:
        return stmt
    inner = stmt.body[0] if len(stmt.body) == 1 and not stmt.orelse else None
    return inner if isinstance(inner, ast.If) and inner.lineno == line else None


def _blocks(tree: ast.AST) -> Iterator[tuple[list[ast.stmt], int]]:
    """Every statement of ``tree`` as ``(its block, its index)``."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                for k, stmt in enumerate(block):
                    if isinstance(stmt, ast.stmt):
                        yield block, k


def _exact_guard(stmt: ast.If) -> tuple[str | None, float | None]:
    """``(X, K)`` of HF's guard on ``X`` with ``C = finfo(X.dtype).max - K``, else ``None``s.

    ``if not torch.isfinite(X).all(): C = torch.finfo(X.dtype).max - K; X =
    torch.clamp(X, min=-C, max=C)`` (the two arguments also positional), nothing else.
    """
    name = _isfinite_all_negated(stmt.test)
    if name is None or stmt.orelse or len(stmt.body) != 2:
        return None, None
    bound, offset = _bound_assignment(stmt.body[0], name)
    if bound is None or not _clamp_assignment(stmt.body[1], name, bound):
        return None, None
    return name, offset


def _is_torch(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _isfinite_all_negated(test: ast.expr) -> str | None:
    """``X`` of ``not torch.isfinite(X).all()``."""
    if not (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)):
        return None
    call = test.operand
    if not (isinstance(call, ast.Call) and not call.args and not call.keywords
            and isinstance(call.func, ast.Attribute) and call.func.attr == "all"):
        return None
    inner = call.func.value
    if not (isinstance(inner, ast.Call) and _is_torch(inner.func, "isfinite")
            and len(inner.args) == 1 and not inner.keywords
            and isinstance(inner.args[0], ast.Name)):
        return None
    return inner.args[0].id


def _bound_assignment(stmt: ast.stmt, name: str) -> tuple[str | None, float | None]:
    """``(C, K)`` of ``C = torch.finfo(X.dtype).max - K``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)):
        return None, None
    value = stmt.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Sub)
            and isinstance(value.right, ast.Constant)
            and type(value.right.value) in (int, float)):
        return None, None
    top = value.left
    if not (isinstance(top, ast.Attribute) and top.attr == "max"
            and isinstance(top.value, ast.Call) and _is_torch(top.value.func, "finfo")
            and len(top.value.args) == 1 and not top.value.keywords):
        return None, None
    arg = top.value.args[0]
    if not (isinstance(arg, ast.Attribute) and arg.attr == "dtype"
            and isinstance(arg.value, ast.Name) and arg.value.id == name):
        return None, None
    offset = value.right.value
    if not isinstance(offset, (int, float)):  # (checked above: for the type checker)
        return None, None
    return stmt.targets[0].id, float(offset)


def _clamp_assignment(stmt: ast.stmt, name: str, bound: str) -> bool:
    """Whether ``stmt`` is ``X = torch.clamp(X, min=-C, max=C)`` (or positional)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name):
        return False
    call = stmt.value
    if not (isinstance(call, ast.Call) and _is_torch(call.func, "clamp") and call.args
            and isinstance(call.args[0], ast.Name) and call.args[0].id == name):
        return False
    given = dict(zip(("min", "max"), call.args[1:], strict=False))
    given.update({k.arg: k.value for k in call.keywords if k.arg is not None})
    if len(call.args) + len(call.keywords) != 3 or set(given) != {"min", "max"}:
        return False
    low, high = given["min"], given["max"]
    return (isinstance(high, ast.Name) and high.id == bound and isinstance(low, ast.UnaryOp)
            and isinstance(low.op, ast.USub) and isinstance(low.operand, ast.Name)
            and low.operand.id == bound)


def _fresh_before(block: list[ast.stmt], index: int, name: str) -> bool:
    """Whether ``name`` holds a value no other name holds when the guard runs.

    Walking back from the guard: statements not naming ``name`` are skipped; the first
    that does must assign it a fresh value (``X = f(...)``, ``X = a + b``: not another
    name), or be an ``if`` whose branches only do so. Anything else (``Y = X``, ``X`` an
    argument of the function) is not recognised.
    """
    for stmt in reversed(block[:index]):
        if not _mentions(stmt, name):
            continue
        if _fresh_assignment(stmt, name):
            return True
        if isinstance(stmt, ast.If) and not _mentions(stmt.test, name) and all(
                _fresh_assignment(s, name) or not _mentions(s, name)
                for s in (*stmt.body, *stmt.orelse)):
            continue
        return False
    return False


def _fresh_assignment(stmt: ast.stmt, name: str) -> bool:
    """``X = <a call or an operation>`` (``X`` the only target)."""
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name
            and isinstance(stmt.value, (ast.Call, ast.BinOp)))


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))

