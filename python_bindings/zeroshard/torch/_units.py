"""How a model is cut into engine units (partition_units), the per-unit bookkeeping, and which
modules share or nest in other units' parameters."""

import enum

import torch

from .. import _core


class GradState(enum.Enum):
    """Where a unit's gradients are in the current backward: none complete yet, some complete,
    or all handed to the engine (the reduction has started; a further gradient is an error).
    Back to WAITING at the end of backward, step() and zero_grad()."""
    WAITING = 0
    ARRIVING = 1
    HANDED = 2


class _Unit:
    """Bookkeeping of one engine unit on the torch side."""

    def __init__(self, index, name, module, names, params):
        self.index = index
        self.name = name
        self.module = module
        self.names = names            # qualified parameter names
        self.params = params          # the nn.Parameters, in registration order
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.grads = GradState.WAITING  # where this backward's gradients are
        self._arrived = set()         # parameters whose gradient is complete (ARRIVING)
        self.gathered = False         # stage 3: parameters present
        self.forward_stack = []       # stage 3: was it gathered before each nested forward?
        self.full = []                # stage 3: torch buffers the gathered values live in
        self.versions = []            # stage 3: parameters' _version when gathered
        self.pre = self.post = None   # stage 3: the module's forward hooks
        self.placeholder = None       # stage 3: what .data is while released

    def grad_arrived(self, i):
        """Notes that parameter i's gradient is complete; True once every parameter's is."""
        self._arrived.add(i)
        self.grads = GradState.ARRIVING
        return len(self._arrived) == len(self.params)

    def set_grads(self, state):
        self.grads = state
        if state is not GradState.ARRIVING:
            self._arrived.clear()


_MODULE_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


_PARAM_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)


# Modules whose forward() reads their children's parameters itself (MultiheadAttention reads
# out_proj.weight; out_proj's forward never runs): one unit whatever their size.
_WHOLE_MODULES = (torch.nn.MultiheadAttention,)


def _tensors(obj):
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def partition_units(model, unit_numel=1 << 25, units=None, trainable=None):
    """Unit boundaries for `model`, as ZeroOptimizer cuts them: a list of
    (name, module, [(param_name, param), ...]). See the module doc for the rules."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    if trainable is None:
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assigned = set()
    out = []

    def take(module, recurse):
        got = []
        for p in module.parameters(recurse=recurse):
            if id(p) in trainable and id(p) not in assigned:
                assigned.add(id(p))
                got.append((names[id(p)], p))
        return got

    if units is not None:
        module_names = {id(m): n for n, m in model.named_modules()}
        for m in units:
            if id(m) not in module_names:
                raise _core.InvalidArgumentError(
                    f"ZeroOptimizer: units contains a {type(m).__name__} that is not a "
                    "submodule of the model")
            ps = take(m, True)
            if ps:
                out.append((module_names[id(m)] or "<root>", m, ps))
        rest = take(model, True)
        if rest:
            out.append(("<rest>", model, rest))
        return out

    def subtree_numel(m):
        return sum(p.numel() for p in m.parameters()
                   if id(p) in trainable and id(p) not in assigned)

    def visit(m, prefix, depth):
        total = subtree_numel(m)
        if total == 0:
            return
        children = [(n, c) for n, c in m.named_children() if subtree_numel(c) > 0]
        # A ModuleList/ModuleDict is never called, so its hooks never fire: it is never a unit,
        # its children are. A ParameterList/ParameterDict is read by its parent's forward: its
        # parameters belong to the parent's unit.
        held = [c for _, c in children if isinstance(c, _PARAM_CONTAINERS)]
        children = [(n, c) for n, c in children if not isinstance(c, _PARAM_CONTAINERS)]
        # The model itself always splits into its children; below it, a module is one unit
        # unless it is too large and has children to split into.
        container = isinstance(m, _MODULE_CONTAINERS)
        whole = total <= unit_numel or not children or isinstance(m, _WHOLE_MODULES)
        if depth > 0 and not container and whole:
            out.append((prefix, m, take(m, True)))
            return
        own = take(m, False)
        for c in held:
            own += take(c, True)
        if own:
            out.append((prefix or "<root>", m, own))
        for n, c in children:
            visit(c, f"{prefix}.{n}" if prefix else n, depth + 1)

    visit(model, "", 0)
    return out


def register_external_parameter(module, parameter):
    """Says that `module`'s forward reads `parameter`, a parameter of another module (a shared
    embedding read by a head's forward, say), as DeepSpeed's
    deepspeed.zero.register_external_parameter does. Call it before building the ZeroOptimizer
    (in the module's __init__, typically): at stage 3 the module's forward then gathers that
    parameter's unit too, and its backward again. Changes nothing at stages 0-2."""
    if not isinstance(module, torch.nn.Module) or not isinstance(parameter, torch.nn.Parameter):
        raise _core.InvalidArgumentError(
            "register_external_parameter(module, parameter): a torch.nn.Module and a "
            "torch.nn.Parameter")
    if getattr(parameter, "_zs_unit", None) is not None:
        raise _core.InvalidArgumentError(
            "register_external_parameter(): the ZeroOptimizer owning this parameter is built "
            "already; register before building it")
    found = module.__dict__.setdefault("_zs_external_params", [])
    if not any(p is parameter for p in found):
        found.append(parameter)


class _UnitsPart:
    """The unit-partitioning part of ZeroOptimizer (nesting, tied weights)."""

    @staticmethod
    def _ancestors(model):
        parent = {}
        for n, m in model.named_modules():
            for c in m.children():
                parent.setdefault(id(c), m)
        return parent

    def _nesting(self, model, unit_list):
        parent = self._ancestors(model)
        unit_modules = {id(m) for _, m, _ in unit_list}
        deepest = 0
        for _, m, _ in unit_list:
            depth, cur = 0, m
            while id(cur) in parent:
                cur = parent[id(cur)]
                depth += id(cur) in unit_modules
            deepest = max(deepest, depth)
        return deepest + 1

    def _tied_users(self, model, unit_list):
        """Stage 3: {module: [unit index, ...]} for modules that hold a parameter of a unit and
        can run without that unit's module running around them: a weight tied across modules
        (an output head sharing the embedding's weight), or a submodule registered under two
        parents (a block's MLP shared with another block). Such a module's forward gathers
        those units too, as their own modules' forwards do."""
        owner = {}
        for index, (_, m, named) in enumerate(unit_list):
            for _, p in named:
                owner[id(p)] = (index, m)
        reach = {}

        def outside(unit_module):
            """The modules reachable from the model without passing through unit_module."""
            if id(unit_module) not in reach:
                seen, stack = set(), [model]
                while stack:
                    m = stack.pop()
                    if m is unit_module or id(m) in seen:
                        continue
                    seen.add(id(m))
                    stack.extend(m.children())
                reach[id(unit_module)] = seen
            return reach[id(unit_module)]

        users = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if id(p) in owner and id(m) in outside(owner[id(p)][1]):
                    found = users.setdefault(m, [])
                    if owner[id(p)][0] not in found:
                        found.append(owner[id(p)][0])
            # Parameters of other modules this one's forward reads, as registered
            # (register_external_parameter).
            for p in m.__dict__.get("_zs_external_params", ()):
                if id(p) in owner and owner[id(p)][1] is not m:
                    found = users.setdefault(m, [])
                    if owner[id(p)][0] not in found:
                        found.append(owner[id(p)][0])
        return users

    def _units_of(self, modules):
        """The units owning a parameter of `modules` (a module or a list; None: the model)."""
        if modules is None:
            modules = self.model
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        ids = {id(p) for m in modules for p in m.parameters()}
        return [u for u in self._units if any(id(p) in ids for p in u.params)]
