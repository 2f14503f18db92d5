"""Imports inside ``mp_wrappers`` point down the layer order of docs/architecture.md, without cycles.

The order is declared once, in the table under "## Layers" of docs/architecture.md: one row per
layer, lowest first, each with ``fnmatch`` patterns of dotted module names. A module belongs to the
layer of its most specific (longest) matching pattern, so a new module under a folder that a
pattern like ``mp_wrappers.wrappers.*`` covers needs no edit here or there.

The graph is read with ``ast`` (nothing is imported): every ``import``/``from ... import`` anywhere
in a module (module level, functions, ``try``/``if``/``TYPE_CHECKING`` blocks), relative ones
resolved, and ``from pkg import name`` resolved to the submodule ``pkg.name`` when there is one.
Importing ``a.b.c`` also runs ``a/b/__init__.py``: an import from outside ``a.b`` counts as an
import of the package too (the root package aside, which every module is loaded through).
"""
import ast
import fnmatch
import os
import re
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = 'mp_wrappers'
# Built from csrc/ by setup.py: absent from a source checkout, so no file names it.
COMPILED_MODULES = ('mp_wrappers._C',)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` (``via``: the import that implies a package's
    ``__init__``, when the edge is implied)."""

    source: str
    line: int
    target: str
    via: Optional[str] = None

    def describe(self, paths: Dict[str, str]) -> str:
        how = f' (its __init__ runs for `{self.via}`)' if self.via else ''
        where = paths.get(self.source, self.source)
        return f'{where}:{self.line}: {self.source} imports {self.target}{how}'


def find_modules(root: str, package: str) -> Dict[str, str]:
    """{dotted module name: path relative to ``root``} of every ``.py`` file of ``package``."""
    modules = {}
    top = os.path.join(root, *package.split('.'))
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != '__pycache__' and not d.startswith('.'))
        for name in sorted(files):
            if not name.endswith('.py'):
                continue
            parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
            if parts[-1] == '__init__':
                parts = parts[:-1]
            modules['.'.join(parts)] = os.path.relpath(os.path.join(folder, name), root)
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` names (``X`` resolved against ``module``)."""
    if not node.level:
        return node.module or ''
    parts = module.split('.') if is_package else module.split('.')[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return '.'.join(parts + ([node.module] if node.module else []))


def _statements(body: Sequence[ast.AST]) -> Iterable[ast.AST]:
    """Every statement in ``body``, nested ones included (imports are statements: expressions,
    most of a tree, are not visited, which keeps the check fast)."""
    for node in body:
        yield node
        for field in ('body', 'orelse', 'finalbody', 'handlers', 'cases'):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children)


def _imported_names(module: str, is_package: bool, tree: ast.Module,
                    known: Set[str]) -> Iterable[Tuple[int, str]]:
    """(line, imported module) for every import statement in ``tree``."""
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f'{base}.{alias.name}'
                yield node.lineno, sub if sub in known else base


def _edges_of(source: str, line: int, target: str, known: Set[str]) -> List[Edge]:
    """The edge to ``target`` and to each package above it whose ``__init__`` the import runs."""
    while target not in known and '.' in target:  # `import a.b.c` of a name inside a module
        target = target.rsplit('.', 1)[0]
    if target not in known or target == source:
        return []
    edges = [Edge(source, line, target)]
    parts = target.split('.')
    for n in range(len(parts) - 1, 1, -1):  # parents below the root package
        parent = '.'.join(parts[:n])
        if source == parent or source.startswith(parent + '.'):
            break  # the source is inside it: that package is loaded already
        edges.append(Edge(source, line, parent, via=target))
    return edges


def build_graph(root: str, package: str = PACKAGE,
                extra_modules: Sequence[str] = ()) -> Tuple[Dict[str, str], List[Edge]]:
    """({module: path}, every import edge between modules of ``package``) of the tree at ``root``."""
    paths = find_modules(root, package)
    known = set(paths) | set(extra_modules)
    edges = []
    for module, path in paths.items():
        with open(os.path.join(root, path), encoding='utf-8') as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith('__init__.py')
        for line, name in _imported_names(module, is_package, tree, known):
            if name == package or name.startswith(package + '.'):
                edges.extend(_edges_of(module, line, name, known))
    return paths, sorted(set(edges), key=lambda e: (e.source, e.line, e.target))


# ---- the declared order ------------------------------------------------------------------------

Layer = Tuple[str, Tuple[str, ...]]  # (name, module patterns)


def read_layers(path: str) -> List[Layer]:
    """The layers of the table under ``## Layers`` in ``path``, lowest first.

    Rows look like ``| 2 | ops | `mp_wrappers.ops` `mp_wrappers.ops.*` | ... |``: the number is the
    position (0, 1, ... in order), the third cell holds the patterns in backticks.
    """
    with open(path, encoding='utf-8') as f:
        text = f.read()
    section = re.search(r'^## Layers\b(.*?)(?=^## |\Z)', text, flags=re.M | re.S)
    assert section, f'{path} has no "## Layers" section'
    layers = []
    rows = re.finditer(r'^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|([^|]*)\|', section.group(1), flags=re.M)
    for row in rows:
        number, name, cell = int(row.group(1)), row.group(2), row.group(3)
        assert number == len(layers), f'{path}: layer {name!r} is numbered {number}, not {len(layers)}'
        layers.append((name, tuple(re.findall(r'`([^`]+)`', cell))))
    return layers


def _specificity(pattern: str) -> Tuple[bool, int]:
    """Exact names first, then the longest literal part."""
    return ('*' not in pattern and '?' not in pattern and '[' not in pattern,
            len(pattern.replace('*', '').replace('?', '')))


def layer_of(module: str, layers: Sequence[Layer]) -> Optional[int]:
    """The index of the layer whose most specific pattern matches ``module`` (None: no match).

    Raises:
        ValueError: two layers match with equally specific patterns.
    """
    best: Optional[Tuple[Tuple[bool, int], int, str]] = None
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if not fnmatch.fnmatchcase(module, pattern):
                continue
            rank = _specificity(pattern)
            if best is not None and rank == best[0] and index != best[1]:
                raise ValueError(f'{module} matches `{best[2]}` (layer {best[1]}) and `{pattern}` '
                                 f'(layer {index}) equally: make one pattern more specific')
            if best is None or rank > best[0]:
                best = (rank, index, pattern)
    return None if best is None else best[1]


# ---- the checks --------------------------------------------------------------------------------

def _strongly_connected(nodes: Iterable[str], succ: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components of more than one module (iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _cycle_through(start: str, members: Set[str], succ: Dict[str, Set[str]]) -> List[str]:
    """A shortest import cycle from ``start`` back to it inside one strongly connected component."""
    parents: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(succ.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if child in members and child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f'no cycle through {start}')  # pragma: no cover - members are an SCC


@dataclass
class Report:
    """What :func:`check` found, one readable line per problem."""

    cycles: List[str]
    upward: List[str]
    unassigned: List[str]


def check(root: str, layers: Sequence[Layer], package: str = PACKAGE,
          extra_modules: Sequence[str] = ()) -> Report:
    """Cycles, imports from a lower layer to a higher one, and modules without a layer."""
    paths, edges = build_graph(root, package, extra_modules)
    modules = sorted(set(paths) | set(extra_modules))
    layer = {m: layer_of(m, layers) for m in modules}
    unassigned = [f'{paths.get(m, m)}: {m} matches no pattern of any layer' for m in modules
                  if layer[m] is None]
    upward = []
    for edge in edges:
        low, high = layer[edge.source], layer[edge.target]
        if low is not None and high is not None and high > low:
            upward.append(f'{edge.describe(paths)}: layer {low} ({layers[low][0]}) imports layer '
                          f'{high} ({layers[high][0]})')
    succ: Dict[str, Set[str]] = {}
    first_line: Dict[Tuple[str, str], Edge] = {}
    for edge in edges:
        succ.setdefault(edge.source, set()).add(edge.target)
        first_line.setdefault((edge.source, edge.target), edge)
    cycles = []
    for component in _strongly_connected(modules, succ):
        cycle = _cycle_through(component[0], set(component), succ)
        steps = [first_line[(a, b)].describe(paths) for a, b in zip(cycle, cycle[1:])]
        cycles.append(f'cycle {" -> ".join(cycle)} (component: {", ".join(component)}):\n    '
                      + '\n    '.join(steps))
    return Report(cycles, upward, unassigned)


# ---- mp_wrappers -------------------------------------------------------------------------------

ARCHITECTURE = os.path.join(REPO, 'docs', 'architecture.md')


def _report() -> Report:
    return check(REPO, read_layers(ARCHITECTURE), extra_modules=COMPILED_MODULES)


def test_layer_table_is_declared():
    layers = read_layers(ARCHITECTURE)
    names = [name for name, _ in layers]
    assert len(layers) >= 3 and len(set(names)) == len(names), names
    assert all(patterns for _, patterns in layers), layers


def test_every_module_has_a_layer():
    unassigned = _report().unassigned
    assert not unassigned, ('add a pattern to the "## Layers" table of docs/architecture.md:\n'
                            + '\n'.join(unassigned))


def test_imports_point_down():
    upward = _report().upward
    assert not upward, (f'{len(upward)} import(s) point up the layers of docs/architecture.md (move '
                        'the imported code down, or the importer up):\n' + '\n'.join(upward))


def test_no_import_cycles():
    cycles = _report().cycles
    assert not cycles, f'{len(cycles)} import cycle(s):\n' + '\n'.join(cycles)


def test_the_check_is_fast():
    start = time.process_time()  # CPU time: other processes on a shared machine do not count
    _report()
    assert time.process_time() - start < 2.0


# ---- the checker itself, on a package built for it -----------------------------------------------

def _write(root, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding='utf-8')


SYNTHETIC_LAYERS = [('low', ('pkg.low*', 'pkg.sub.leaf')), ('high', ('pkg', 'pkg.high', 'pkg.sub'))]


def test_checker_reports_a_cycle_an_up_import_and_a_module_without_a_layer(tmp_path):
    _write(tmp_path, {
        'pkg/__init__.py': '',
        'pkg/high.py': 'from .low import f\n',
        'pkg/low.py': 'def f():\n    from . import high  # up, and back: a cycle\n',
        'pkg/low_b.py': 'import pkg.low_c\n',
        'pkg/low_c.py': 'from pkg import low_b\n',  # a cycle within one layer
        'pkg/stray.py': '',
    })
    report = check(str(tmp_path), SYNTHETIC_LAYERS, package='pkg')
    assert report.upward == [
        'pkg/low.py:2: pkg.low imports pkg.high: layer 0 (low) imports layer 1 (high)']
    assert len(report.cycles) == 2
    assert report.cycles[0].startswith('cycle pkg.high -> pkg.low -> pkg.high')
    assert 'pkg/high.py:1: pkg.high imports pkg.low' in report.cycles[0]
    assert 'pkg/low.py:2: pkg.low imports pkg.high' in report.cycles[0]
    assert report.cycles[1].startswith('cycle pkg.low_b -> pkg.low_c -> pkg.low_b')
    assert report.unassigned == ['pkg/stray.py: pkg.stray matches no pattern of any layer']


def test_checker_resolves_relative_names_and_package_inits(tmp_path):
    _write(tmp_path, {
        'pkg/__init__.py': 'from . import high\n',
        'pkg/high.py': 'import pkg.sub.leaf as leaf\nfrom .sub import helper\n',
        'pkg/low.py': ('class C:\n    def m(self):\n        from .sub.leaf import g\n'
                       '        from ..outside import x\n        import os\n'),
        'pkg/sub/__init__.py': 'from ..high import y\nhelper = 1\n',
        'pkg/sub/leaf.py': 'from .. import low\nfrom . import helper\n',
    })
    paths, edges = build_graph(str(tmp_path), 'pkg')
    assert paths['pkg.sub'] == os.path.join('pkg', 'sub', '__init__.py')
    got = {(e.source, e.line, e.target, e.via) for e in edges}
    assert got == {
        ('pkg', 1, 'pkg.high', None),
        ('pkg.high', 1, 'pkg.sub.leaf', None),
        ('pkg.high', 1, 'pkg.sub', 'pkg.sub.leaf'),  # importing pkg.sub.leaf runs pkg/sub/__init__
        ('pkg.high', 2, 'pkg.sub', None),  # `helper` is no module: the package itself
        ('pkg.low', 3, 'pkg.sub.leaf', None),  # in a method
        ('pkg.low', 3, 'pkg.sub', 'pkg.sub.leaf'),
        ('pkg.sub', 1, 'pkg.high', None),
        ('pkg.sub.leaf', 1, 'pkg.low', None),
        ('pkg.sub.leaf', 2, 'pkg.sub', None),  # its own package: no implied edge, a plain one
    }
    report = check(str(tmp_path), SYNTHETIC_LAYERS, package='pkg')
    assert report.upward == [
        'pkg/low.py:3: pkg.low imports pkg.sub (its __init__ runs for `pkg.sub.leaf`): layer 0 (low) '
        'imports layer 1 (high)',
        'pkg/sub/leaf.py:2: pkg.sub.leaf imports pkg.sub: layer 0 (low) imports layer 1 (high)']
    assert report.cycles and not report.unassigned


def test_the_most_specific_pattern_places_a_module():
    layers = [('low', ('pkg.a.*', 'pkg.a.b.c')), ('high', ('pkg.a.b*', 'pkg.x*')), ('top', ('pkg.x?',))]
    assert layer_of('pkg.a.z', layers) == 0
    assert layer_of('pkg.a.b', layers) == 1  # `pkg.a.b*` is longer than `pkg.a.*`
    assert layer_of('pkg.a.b.c', layers) == 0  # a name beats every wildcard
    assert layer_of('pkg.q', layers) is None
    with pytest.raises(ValueError, match='equally'):
        layer_of('pkg.xy', layers)  # `pkg.x*` and `pkg.x?`: the same literal part
