"""Forward hooks of inner modules that observe: called with real values at every step.

A forward hook or pre-hook registered on an inner module of a wrapped model ran while the
model was exported, on fake tensors, and never again: the stages run the graph, not the
modules (until stop 85; :func:`~optmem.pytorch.hooks.warn_forward_hooks`). A hook that
*returns* a value changes the tensors, and that change is in the graph; a hook that returns
``None`` is an **observer** (activation logging ``acts[name] = out.detach()``, counters,
feature extraction, histograms): its only effect is its Python, which must run at every
call as on the plain model.

How (stop 85):

1. :func:`hooks_recorded` wraps the user's forward hooks of the inner modules while the
   model is exported, recording every call (module, kind, hook id) and whether it returned
   ``None``; the export keeps the call signature of those modules
   (``preserve_module_call_signature``), so the graph names the nodes that are each call's
   arguments and output (``ExportedProgram.module_call_graph``).
2. :func:`observer_plan` keeps the observers whose values are all graph nodes (or
   constants): one :class:`ObserverCall` each, in the order the model called them.
3. The stage graphs get one :func:`observe` node after each such value (wherever a stage
   computes or reads it); it does nothing unless a step is :func:`observing`.
4. The wrapper runs the forward of a step under :func:`observing`: each value is taken
   the first time a stage gives it (a stage the plan re-runs in the backward runs after
   the step's forward, unobserved), and each hook is called as soon as its values and those
   of the hooks the model calls before it are there, with the real tensors, in the model's
   order, once per step.

Extraction, profiling and measuring run outside any step: the stages call no hook there.

Stop 86: a hook that returns ``None`` but writes a tensor it received in place is not an
observer (its write is in the graph); the hooks of the model itself are left out of the
graph and called by the wrapper around the plan (:func:`root_hooks_suspended`,
:func:`call_with_root_hooks`); a user's global module hook is warned
(:func:`warn_global_hooks`).

Stop 87: a user's global module forward hook (``register_module_forward_hook``, the
pre-hook's) is called by the wrapper's export on the model's own modules
(:func:`global_hooks_traced`): one that returns a value (or writes in place) for some of
them is in the graph, as on the plain model; at a step, those calls torch makes on
optmem's own modules (the stages) must then change nothing, which
:func:`global_modifiers_checked` checks (one ``OptmemInputError`` otherwise). The
observers among them stay as before: warned, called on the stage calls.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from optmem.errors import OptmemInputError
from optmem.pytorch.hooks import hooks_emptied, library_hook, suspended_global_hooks

_log = logging.getLogger("optmem")

__all__ = ["GlobalHook", "HookCall", "ObserverCall", "ObserverPlan", "call_with_root_hooks",
           "global_hooks_traced", "global_modifiers_checked", "has_root_hooks",
           "hooked_modules", "hooks_recorded", "observe", "observer_plan",
           "hook_code", "observers_silenced", "observing", "root_hooks_suspended",
           "user_global_hooks",
           "warn_global_hooks"]


@dataclass(frozen=True)
class HookCall:
    """One call of a user's forward hook while the model was exported.

    Attributes
    ----------
    module_name
        The inner module's qualified name.
    pre
        A pre-hook (``register_forward_pre_hook``), else a forward hook.
    hook_id
        Its handle's id (the key in the module's hook dictionary).
    observer
        Whether it returned ``None``.
    """

    module_name: str
    pre: bool
    hook_id: int
    observer: bool


def _hook_dict(sub: nn.Module, pre: bool) -> dict[int, Any]:
    """The module's own dictionary of forward pre-hooks (``pre``) or forward hooks."""
    return sub._forward_pre_hooks if pre else sub._forward_hooks


def _user_hooks(sub: nn.Module, pre: bool) -> dict[int, Any]:
    """The module's forward (or pre-) hooks a user registered, by id.

    A library's own (:func:`~optmem.pytorch.hooks.library_hook`) are left out: they stay
    as before.
    """
    return {k: h for k, h in _hook_dict(sub, pre).items() if not library_hook(h)}


def hooked_modules(model: nn.Module) -> tuple[str, ...]:
    """The inner modules of ``model`` with a user's forward hook or pre-hook, by name."""
    return tuple(name for name, sub in model.named_modules()
                 if name and (_user_hooks(sub, True) or _user_hooks(sub, False)))


@contextmanager
def hooks_recorded(model: nn.Module) -> Iterator[list[HookCall]]:
    """Within: the user's forward hooks of inner modules record their calls (in order).

    Each hook is replaced in its dictionary (same key, same place) by a function that calls
    it and records a :class:`HookCall`; on exit the hooks are put back.
    """
    met: list[HookCall] = []
    replaced: list[tuple[dict[int, Any], int, Any, Any]] = []
    for name, sub in model.named_modules():
        if not name:
            continue
        for pre in (True, False):
            hooks = _hook_dict(sub, pre)
            for key, hook in _user_hooks(sub, pre).items():
                wrapper = _recording(hook, HookCall(name, pre, key, True), met)
                hooks[key] = wrapper
                replaced.append((hooks, key, hook, wrapper))
    try:
        yield met
    finally:
        for hooks, key, hook, wrapper in replaced:
            if hooks.get(key) is wrapper:
                hooks[key] = hook


def _recording(hook: Callable[..., Any], call: HookCall,
               met: list[HookCall]) -> Callable[..., Any]:
    def record(module: nn.Module, *args: Any) -> Any:
        out, changed = _called(hook, module, args)
        met.append(HookCall(call.module_name, call.pre, call.hook_id, not changed))
        return out

    return record


def _called(hook: Callable[..., Any], module: nn.Module, args: tuple[Any, ...]
            ) -> tuple[Any, bool]:
    """``hook(module, *args)``, and whether it changed something.

    Changed: it returned a value or wrote one of the tensors it received in place (a
    modifier, not an observer).
    """
    received = _versions(args)
    out = hook(module, *args)
    return out, out is not None or _versions(args) != received


def _versions(values: Any) -> list[int]:
    """The version counters of the tensors among ``values`` (an in-place write moves one)."""
    return [t._version for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


@dataclass
class GlobalHook:
    """A user's global module forward hook (or pre-hook) while the wrapper's export ran.

    Attributes
    ----------
    key
        Its handle's id (its key in ``torch.nn.modules.module._global_forward_hooks`` or
        ``_global_forward_pre_hooks``).
    pre
        A pre-hook (``register_module_forward_pre_hook``).
    hook
        The hook.
    modifier
        Whether one of its calls returned a value or wrote a tensor it received in place
        (then its effect is in the graph).
    failed
        Whether one of its calls raised (on the export's fake tensors); the error is
        dropped there, and the hook is left as before stop 87 (warned at a step).
    """

    key: int
    pre: bool
    hook: Callable[..., Any]
    modifier: bool = False
    failed: bool = False


_GLOBAL_KINDS = ((True, "_global_forward_pre_hooks"), (False, "_global_forward_hooks"))
_GLOBAL_FLAGS = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def user_global_hooks(observers: Collection[Any] = ()) -> tuple[int, ...]:
    """The handle ids of the user's global module forward hooks and pre-hooks, in order.

    Not a library's (:func:`~optmem.pytorch.hooks.library_hook`: torch's tools register
    and remove theirs around each step), nor one whose code is among ``observers`` (the
    code of hooks an export found to return ``None`` everywhere, :func:`hook_code`: a
    tracker of the user's that registers its hook around each step extracts once). A
    change of the others is a change of the model's computation for the wrapper's graph
    (:func:`global_hooks_traced`).

    Examples
    --------
    >>> user_global_hooks()
    ()
    """
    from torch.nn.modules import module as module_mod

    if not (module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks):
        return ()
    return tuple(k for _, name in _GLOBAL_KINDS for k, h in getattr(module_mod, name).items()
                 if not library_hook(h) and hook_code(h) not in observers)


def hook_code(hook: Any) -> Any:
    """The code object a hook runs (a function's, a bound method's, a callable object's).

    Examples
    --------
    >>> hook_code(print) is None
    True
    """
    while isinstance(hook, functools.partial):
        hook = hook.func
    code = getattr(hook, "__code__", None)
    if code is None and not isinstance(hook, type):
        call = getattr(type(hook), "__call__", None)  # noqa: B004 - the class's, not callable()
        code = getattr(call, "__code__", None)
    return code


@contextmanager
def global_hooks_traced(model: nn.Module, seen: list[GlobalHook]) -> Iterator[None]:
    """Within (the wrapper's export): the user's global forward hooks run on ``model``'s modules.

    The wrapper's setup runs without the global module hooks
    (:func:`~optmem.pytorch.hooks.callers_tools_suspended`): they are the caller's tools.
    A user's own (not a library's, :func:`~optmem.pytorch.hooks.library_hook`) may change
    the model's numbers (``o * 0.5`` for every ``nn.Linear``): until stop 87 the graph
    lacked it, and the wrapper computed other numbers than the plain model, under one
    warning. Here each of them is put back in its registry (same key, same place, its
    ``with_kwargs`` and ``always_call`` flags) behind a gate that calls it for the
    modules of ``model`` only (the root included; not the export's own wrapper module),
    so what it returns is traced as on the plain model, and records in ``seen`` (one
    :class:`GlobalHook` per hook, cleared on entry) whether it changed something. An
    observer is called too, once per module, on the export's fake tensors (as an inner
    module's hook is). On exit the registries are as on entry (empty).
    """
    from torch.nn.modules import module as module_mod

    seen.clear()
    suspended = suspended_global_hooks()
    ids = {id(m) for m in model.modules()}
    added: list[tuple[dict[int, Any], int]] = []
    for pre, name in _GLOBAL_KINDS:
        for key, hook in suspended[name]:
            if library_hook(hook):
                continue
            entry = GlobalHook(key, pre, hook)
            seen.append(entry)
            registry = getattr(module_mod, name)
            registry[key] = _traced_gate(entry, ids)
            added.append((registry, key))
            for flag in () if pre else _GLOBAL_FLAGS:
                value = dict(suspended[flag]).get(key)
                if value is not None:
                    getattr(module_mod, flag)[key] = value
                    added.append((getattr(module_mod, flag), key))
    try:
        yield
    finally:
        for registry, key in added:
            registry.pop(key, None)


def _traced_gate(entry: GlobalHook, ids: Collection[int]) -> Callable[..., Any]:
    """The hook of ``entry`` for the modules whose ids are ``ids``, recording what it does."""

    def gate(module: nn.Module, *args: Any) -> Any:
        if id(module) not in ids:
            return None
        try:
            out, changed = _called(entry.hook, module, args)
        except Exception:  # noqa: BLE001 - on fake tensors: left as before (warned)
            entry.failed = True
            return None
        entry.modifier |= changed
        return out

    return gate


@contextmanager
def global_modifiers_checked(keys: Iterable[tuple[int, bool]]) -> Iterator[None]:
    """Within (a step's forward): the global hooks in the graph must change nothing more.

    ``keys``: the ``(handle id, pre)`` of the global hooks whose effect is in the graph
    (:func:`global_hooks_traced`). torch calls them on every module call, so on optmem's
    own modules too (the wrapper's stages); on those each must return ``None`` and write
    nothing, or its effect would be applied twice: one ``OptmemInputError`` then, naming
    the hook. A hook no longer registered (possible only in a wrapper loaded from a file:
    in the process that traced it, the wrapper extracts again first) is an
    ``OptmemInputError`` too. On exit each is back in its place.
    """
    from torch.nn.modules import module as module_mod

    replaced: list[tuple[dict[int, Any], int, Any, Any]] = []
    for key, pre in keys:
        registry = getattr(module_mod, _GLOBAL_KINDS[0 if pre else 1][1])
        hook = registry.get(key)
        if hook is None:  # the state check extracts again first: a wrapper saved and loaded
            raise OptmemInputError(
                "this wrapper's graph holds the effect of a global module forward hook that "
                "is no longer registered (a wrapper saved with torch.save and loaded "
                "elsewhere): wrap the model again", field="module")
        registry[key] = gate = _checked_gate(hook)
        replaced.append((registry, key, hook, gate))
    try:
        yield
    finally:
        for registry, key, hook, gate in replaced:
            if registry.get(key) is gate:
                registry[key] = hook


def _checked_gate(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, refusing a value returned (or a write) for one of optmem's own modules."""

    def gate(module: nn.Module, *args: Any) -> Any:
        out, changed = _called(hook, module, args)
        if changed and type(module).__module__.startswith("optmem."):
            name = getattr(hook, "__qualname__", repr(hook))
            raise OptmemInputError(
                f"the global module forward hook {name} changes the output of optmem's own "
                f"module {type(module).__name__}: optmem traced its effect on the model's "
                "modules into its graph, and the plan calls its stages as modules, so it "
                "would be applied twice. Make it return None for the modules it does not "
                "target (test isinstance(module, nn.Linear), or membership in a set of your "
                "modules), or register it on those modules (module.register_forward_hook)",
                field="module")
        return out

    return gate


@dataclass(frozen=True)
class ObserverCall:
    """An observing hook to call at every step, and where its arguments come from.

    ``inputs`` and ``outputs`` are the leaves of the module call's ``(args, kwargs)`` and of
    its output: ``("node", name)`` (a graph value, taken by :func:`observe`) or
    ``("const", value)``; ``in_spec`` and ``out_spec`` rebuild them.
    """

    module: nn.Module
    module_name: str
    pre: bool
    hook_id: int
    with_kwargs: bool
    inputs: tuple[tuple[str, Any], ...]
    in_spec: TreeSpec
    outputs: tuple[tuple[str, Any], ...] = ()
    out_spec: TreeSpec | None = None

    @cached_property
    def needs(self) -> frozenset[str]:
        """The graph values the call needs."""
        return frozenset(v for kind, v in (*self.inputs, *self.outputs) if kind == "node")

    def hook(self) -> Callable[..., Any] | None:
        """The hook, if it is still registered (``None`` once removed)."""
        return _hook_dict(self.module, self.pre).get(self.hook_id)

    def call(self, values: dict[str, Any]) -> None:
        """Call the hook with the values of this step, as the module's call does."""
        hook = self.hook()
        if hook is None:
            return
        args, kwargs = tree_unflatten([_value(leaf, values) for leaf in self.inputs],
                                      self.in_spec)
        given = (args, kwargs) if self.with_kwargs else (args,)
        if not self.pre:
            assert self.out_spec is not None
            given += (tree_unflatten([_value(leaf, values) for leaf in self.outputs],
                                     self.out_spec),)
        hook(self.module, *given)


def _value(leaf: tuple[str, Any], values: dict[str, Any]) -> Any:
    kind, value = leaf
    return values[value] if kind == "node" else value


@dataclass(frozen=True)
class ObserverPlan:
    """The observing hooks of one extraction, in the model's call order.

    ``on_grad_path``: the values that require grad in the model's own training call (on
    the path from the parameters or the inputs that require grad to the output).
    """

    calls: tuple[ObserverCall, ...] = ()
    on_grad_path: frozenset[str] = frozenset()
    #: the hooks that returned a value (or wrote a tensor in place): in the graph
    modifiers: tuple[Callable[..., Any], ...] = ()
    #: the user's global hooks in the graph, ``(handle id, pre)`` (:func:`global_hooks_traced`)
    global_modifiers: tuple[tuple[int, bool], ...] = ()
    #: those hooks (not pickled: a saved wrapper holds no global hook)
    global_hooks: tuple[Callable[..., Any], ...] = ()
    #: the code of the user's global hooks that returned ``None`` on every module (not
    #: pickled: code objects are not)
    global_observers: frozenset[Any] = frozenset()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the global hooks and their code (see the attributes)."""
        return {**self.__dict__, "global_hooks": (), "global_observers": frozenset()}

    @cached_property
    def taps(self) -> frozenset[str]:
        """The graph values the calls need."""
        return frozenset(n for c in self.calls for n in c.needs)

    @cached_property
    def first_reader(self) -> dict[str, str]:
        """The module whose hook receives each value first (named in errors)."""
        first: dict[str, str] = {}
        for c in self.calls:
            for n in c.needs:
                first.setdefault(n, c.module_name)
        return first

    @property
    def hook_ids(self) -> frozenset[int]:
        """The ids of the hooks called at every step."""
        return frozenset(c.hook_id for c in self.calls)

    def keep(self, available: Iterable[str], on_grad_path: Iterable[str] = ()
             ) -> ObserverPlan:
        """The calls of the hooks whose values are all in ``available`` (stages give them)."""
        have = set(available)
        lost = {c.hook_id for c in self.calls if not c.needs <= have}  # all its calls or none
        return ObserverPlan(tuple(c for c in self.calls if c.hook_id not in lost),
                            frozenset(on_grad_path), self.modifiers, self.global_modifiers,
                            self.global_hooks, self.global_observers)


def observer_plan(model: nn.Module, met: list[HookCall], call_graph: Iterable[Any],
                  in_graph: Callable[[str], bool],
                  constants: dict[str, Any] | None = None,
                  global_met: Iterable[GlobalHook] = ()) -> ObserverPlan:
    """The observers among ``met`` that can be called with values of the graph.

    ``call_graph``: the export's ``module_call_graph``; ``in_graph``: whether a node name
    is in the graph the stages are cut from; ``constants``: the values of the nodes
    computed from no input (passed as they are; ``None`` for one no longer in the graph:
    a constant attention mask optmem elided, which HF's eager call does not make). A
    module called several times (ALBERT's shared layer) has one signature per call
    (``name``, ``name@1``, ...), its hooks one call each. Left out (they stay as at
    extraction, warned), every call of: a hook on a module with a hook of the same kind
    that returned a value (the graph's values are after it), and a hook one of whose
    calls has arguments or an output that are neither graph values nor constants.
    ``global_met``: the user's global hooks the export called (:func:`global_hooks_traced`);
    those that modified are listed as modifiers too.
    """
    signatures = {e.fqn: e.signature for e in call_graph if getattr(e, "signature", None)}
    modifies = {(m.module_name, m.pre) for m in met if not m.observer}
    seen: Counter[tuple[str, bool, int]] = Counter()
    calls: list[ObserverCall] = []
    dropped: set[int] = set()
    for m in met:
        k = seen[(m.module_name, m.pre, m.hook_id)]
        seen[(m.module_name, m.pre, m.hook_id)] += 1
        sig = signatures.get(m.module_name if not k else f"{m.module_name}@{k}")
        call = None if (not m.observer or (m.module_name, m.pre) in modifies or sig is None) \
            else _observer_call(model, m, sig, in_graph, constants or {})
        if call is None:
            dropped.add(m.hook_id)
        else:
            calls.append(call)
    modifiers = {m.hook_id: _hook_dict(model.get_submodule(m.module_name), m.pre).get(m.hook_id)
                 for m in met if not m.observer}
    changed = [g for g in global_met if g.modifier]
    failed = [g for g in changed if g.failed]
    if failed:
        name = getattr(failed[0].hook, "__qualname__", repr(failed[0].hook))
        raise OptmemInputError(
            f"the global module forward hook {name} changes some of {type(model).__name__}'s "
            "module outputs but raised on others while optmem traced the model (on fake "
            "tensors, torch.compiler.is_exporting() true): its effect cannot be put in "
            "optmem's graph exactly. Make it run on fake tensors (no .item(), .numpy(), "
            "tensor hooks), or register it on the modules it targets "
            "(module.register_forward_hook)", field="module")
    return ObserverPlan(tuple(c for c in calls if c.hook_id not in dropped),
                        modifiers=tuple(h for h in modifiers.values() if h is not None),
                        global_modifiers=tuple((g.key, g.pre) for g in changed),
                        global_hooks=tuple(g.hook for g in changed),
                        global_observers=frozenset(
                            hook_code(g.hook) for g in global_met
                            if not (g.modifier or g.failed)) - {None})


def _observer_call(model: nn.Module, m: HookCall, sig: Any, in_graph: Callable[[str], bool],
                   constants: dict[str, Any]) -> ObserverCall | None:
    """The call of ``m`` with the values its module call's signature ``sig`` names."""
    inputs = _leaves(sig.inputs, in_graph, constants)
    outputs = () if m.pre else _leaves(sig.outputs, in_graph, constants)
    if inputs is None or outputs is None:
        return None
    sub = model.get_submodule(m.module_name)
    kinds = sub._forward_pre_hooks_with_kwargs if m.pre else sub._forward_hooks_with_kwargs
    return ObserverCall(sub, m.module_name, m.pre, m.hook_id, bool(kinds.get(m.hook_id)),
                        inputs, sig.in_spec, outputs, None if m.pre else sig.out_spec)


def _leaves(specs: Iterable[Any], in_graph: Callable[[str], bool], constants: dict[str, Any]
            ) -> tuple[tuple[str, Any], ...] | None:
    """``("node", name)`` or ``("const", value)`` per argument; ``None`` if one is neither."""
    from torch.export.graph_signature import ConstantArgument, TensorArgument

    leaves: list[tuple[str, Any]] = []
    for spec in specs:
        if isinstance(spec, TensorArgument) and spec.name in constants:
            # elided from the graph: a trivial attention mask, None in HF's eager call
            leaves.append(("const", constants[spec.name] if in_graph(spec.name) else None))
        elif isinstance(spec, TensorArgument) and in_graph(spec.name):
            leaves.append(("node", spec.name))
        elif isinstance(spec, ConstantArgument):
            leaves.append(("const", spec.value))
        else:
            return None
    return tuple(leaves)


@dataclass
class _Step:
    """The values taken so far in one step's forward, and the next hook to call."""

    plan: ObserverPlan
    values: dict[str, Any] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    next: int = 0
    left: Counter[str] = field(default_factory=Counter)
    grad: bool = True

    def __post_init__(self) -> None:
        for c in self.plan.calls:
            self.left.update(c.needs)

    def take(self, name: str, value: Any) -> None:
        if name in self.seen or name not in self.left:
            return
        self.seen.add(name)
        if self.grad and name in self.plan.on_grad_path and isinstance(value, torch.Tensor) \
                and (value.is_floating_point() or value.is_complex()):
            value = _unkept(value, self.plan.first_reader[name])
        self.values[name] = value
        self.call_ready()

    def call_ready(self) -> None:
        calls = self.plan.calls
        while self.next < len(calls) and calls[self.next].needs <= self.seen:
            call = calls[self.next]
            self.next += 1
            call.call(self.values)
            for n in call.needs:
                self.left[n] -= 1
                if not self.left[n]:
                    self.values.pop(n, None)

    def finish(self) -> None:
        """After the forward: the calls still waiting (a value no stage gave), logged."""
        waiting = self.plan.calls[self.next:]
        if waiting:
            _log.info("optmem: forward hooks of %s not called this step (values not "
                      "computed in the forward: %s)", ", ".join(c.module_name for c in waiting),
                      ", ".join(sorted(set().union(*(c.needs - self.seen for c in waiting)))))


class _Unkept(torch.autograd.Function):
    """Identity whose backward refuses: a hook's tensor used in a loss (see :func:`_unkept`)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, where: str) -> torch.Tensor:  # noqa: D102
        ctx.where = where
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # noqa: D102
        raise OptmemInputError(
            f"a tensor the forward hook of {ctx.where} received was back-propagated: "
            "optmem's plan computes it without keeping its graph (the stage may run "
            "without gradients, or again in the backward), so gradients through it would "
            "be lost. Compute the loss from the model's output, or pass an nn.Sequential "
            "of blocks or a list of stage modules (stages that are your modules run their "
            "hooks themselves)", field="module")


def _unkept(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t``'s values as a tensor that requires grad, as the model's hook receives it.

    Its ``.detach()`` is ``t``'s values; a backward through it raises one
    ``OptmemInputError`` (not a silent loss of the gradients the model's call would give).
    """
    with torch.enable_grad():
        return _Unkept.apply(t.detach().requires_grad_(), where)  # type: ignore[no-any-return]


_STEP: ContextVar[_Step | None] = ContextVar("optmem_observed_step", default=None)


@torch.compiler.disable
def observe(name: str, value: Any) -> None:
    """In a stage graph, after the value ``name``: hand it to the step being observed."""
    step = _STEP.get()
    if step is not None:
        step.take(name, value)


@contextmanager
def observing(plan: ObserverPlan | None, side: Mapping[str, Any] | None = None
              ) -> Iterator[None]:
    """Within: the forward of one step, whose stages hand their values to the hooks.

    ``side``: the call's inputs and side values, by node name (taken first). Runs of the
    stages outside (the plan's re-runs in the backward, profiling) call none.
    """
    if plan is None or not (plan.calls or plan.global_modifiers):
        yield
        return
    if not plan.calls:  # the global hooks in the graph only
        with global_modifiers_checked(plan.global_modifiers):
            yield
        return
    step = _Step(plan, grad=torch.is_grad_enabled())
    for name in plan.taps & set(side or ()):
        step.take(name, side[name])  # type: ignore[index]
    token = _STEP.set(step)
    try:
        with global_modifiers_checked(plan.global_modifiers):
            yield
    finally:
        _STEP.reset(token)
    step.finish()


@contextmanager
def observers_silenced(model: nn.Module, hook_ids: Collection[int]) -> Iterator[None]:
    """Within: the forward hooks of ``model`` with these ids are not called.

    For optmem's own runs of the model (measuring the plain step's peak): the observers
    (:class:`ObserverPlan`) return ``None``, so the run computes the same without them,
    and they see the user's steps only. On exit every dictionary is as before, in order
    (hooks registered meanwhile after).
    """
    saved: list[tuple[dict[int, Any], list[tuple[int, Any]]]] = []
    if hook_ids:
        for sub in model.modules():
            for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
                if any(k in hook_ids for k in hooks):
                    saved.append((hooks, list(hooks.items())))
                    for k in hook_ids:
                        hooks.pop(k, None)
    try:
        yield
    finally:
        for hooks, items in saved:
            kept = {k for k, _ in items}
            added = [(k, h) for k, h in hooks.items() if k not in kept]
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


torch.fx.node.has_side_effect(observe)  # kept by dead-code elimination


def has_root_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself has forward hooks or pre-hooks (those the wrapper calls)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


@contextmanager
def root_hooks_suspended(module: nn.Module) -> Iterator[None]:
    """Within (the wrapper's extraction and measuring): ``module``'s own forward hooks off.

    Its forward hooks and pre-hooks are not called. The wrapper calls them itself around
    the plan at every step (:func:`call_with_root_hooks`, stop 86): the graph is the
    model's ``forward`` alone, so a hook that returns a value is applied once, with the
    values of the step (its Python runs: a float it reads is read at every call), and an
    observer sees every step. On exit the dictionaries are as before, in order (hooks
    registered meanwhile after).
    """
    with hooks_emptied((module._forward_pre_hooks, module._forward_hooks)):
        yield


def call_with_root_hooks(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         run: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
    """``run(args, kwargs)`` between ``module``'s own forward pre-hooks and forward hooks.

    As ``nn.Module.__call__`` calls them around ``forward`` (``with_kwargs``,
    ``always_call``; the global hooks are the caller's tools: they see the wrapper's
    call): a pre-hook's returned arguments are those ``run`` receives, a forward hook's
    returned value is the output.
    """
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            new = hook(module, args, kwargs)
            if new is not None:
                if not (isinstance(new, tuple) and len(new) == 2):
                    raise RuntimeError("forward pre-hook must return None or a tuple of "
                                       f"(new_args, new_kwargs), but got {new}.")
                args, kwargs = new
        else:
            new = hook(module, args)
            if new is not None:
                args = new if isinstance(new, tuple) else (new,)
    result: Any = None
    called: set[int] = set()
    try:
        result = run(args, kwargs)
        for hook_id, hook in list(module._forward_hooks.items()):
            called.add(hook_id)
            result = _forward_hook_result(module, hook_id, hook, args, kwargs, result)
    except Exception:
        for hook_id, hook in list(module._forward_hooks.items()):
            if hook_id in module._forward_hooks_always_called and hook_id not in called:
                try:
                    result = _forward_hook_result(module, hook_id, hook, args, kwargs, result)
                except Exception as exc:  # noqa: BLE001 - as torch: the forward's error wins
                    warnings.warn("module forward hook with ``always_call=True`` raised an "
                                  "exception that was silenced as another error was raised "
                                  f"in forward: {exc}", stacklevel=2)
        raise
    return result


def _forward_hook_result(module: nn.Module, hook_id: int, hook: Callable[..., Any],
                         args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
    """The output after one forward hook (its returned value, if any)."""
    if hook_id in module._forward_hooks_with_kwargs:
        new = hook(module, args, kwargs, result)
    else:
        new = hook(module, args, result)
    return result if new is None else new


def warn_global_hooks(warned: set[int], traced: Collection[int] = ()) -> None:
    """Warn once per hook about a user's global module forward hook (not torch's own tools).

    ``torch.nn.modules.module.register_module_forward_hook`` (and the pre-hook's) is called
    on every module call: on the plain model, on each of its modules; on the wrapper,
    on optmem's stage calls, since the plan runs the model's inner modules as one traced
    graph (extraction runs without it: :func:`~optmem.pytorch.hooks.callers_tools_suspended`).
    A hook that returns a value for some modules (``o * 0.5`` on every ``nn.Linear``) or
    records them computed other numbers, in silence, until stop 86; since stop 87 one that
    returns a value is in the graph (:func:`global_hooks_traced`; its id in ``traced``, not
    named). torch's tools (``ModTracker``, ``MemTracker``), whose hooks are torch's, are not
    named. ``warned``: the ids already warned about (updated).
    """
    from torch.nn.modules import module as module_mod

    for hooks in (module_mod._global_forward_pre_hooks, module_mod._global_forward_hooks):
        for hook_id, hook in hooks.items():
            if hook_id in warned or hook_id in traced or library_hook(hook):
                continue
            warned.add(hook_id)
            name = getattr(hook, "__qualname__", repr(hook))
            warnings.warn(
                f"a global module forward hook is registered ({name}, "
                "torch.nn.modules.module.register_module_forward_hook or _pre_hook) that "
                "returned None on every module when optmem traced the model (or raised on its "
                "fake tensors): optmem runs the model's inner modules as one traced graph, so "
                "at a step the hook is called on optmem's stages, not on them as on the plain "
                "model. Register it on the modules themselves before wrapping "
                "(module.register_forward_hook: one that returns None is called at every step "
                "with the real values)", stacklevel=4)
