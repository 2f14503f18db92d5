"""The size limits that keep the house readable (docs/architecture.md, "Size limits"): no module in
``mp_wrappers/`` over 500 lines, ``wrappers/base.py`` at most 400, no function or method over 60 lines.
The pure-PyTorch kernel references (``ops/reference*``) are exempt: each mirrors one kernel, and
splitting one would hide the arithmetic that the kernel tests compare against."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / 'mp_wrappers'
MODULE_LINES, BASE_LINES, FUNCTION_LINES = 500, 400, 60


def _modules():
    assert (PACKAGE / '__init__.py').is_file(), PACKAGE
    return sorted(p for p in PACKAGE.rglob('*.py')
                  if not p.relative_to(PACKAGE).as_posix().startswith('ops/reference'))


def long_functions(path: pathlib.Path, limit: int = FUNCTION_LINES):
    """(qualified name, lines) of every function in ``path`` longer than ``limit`` lines."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = getattr(child, 'name', None)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    out.append((prefix + child.name, lines))
            visit(child, prefix + name + '.' if name else prefix)

    visit(ast.parse(path.read_text()), '')
    return out


def test_modules_are_short():
    too_long = {}
    for path in _modules():
        lines = len(path.read_text().splitlines())
        limit = BASE_LINES if path == PACKAGE / 'wrappers' / 'base.py' else MODULE_LINES
        if lines > limit:
            too_long[path.relative_to(PACKAGE).as_posix()] = (lines, limit)
    assert not too_long, f'modules over their line limit (lines, limit): {too_long}'


def test_functions_are_short():
    offenders = {path.relative_to(PACKAGE).as_posix(): found for path in _modules()
                 if (found := long_functions(path))}
    assert not offenders, f'functions over {FUNCTION_LINES} lines: {offenders}'


def test_the_checker_can_fail(tmp_path):
    body = ''.join(f'        x{i} = {i}\n' for i in range(FUNCTION_LINES))
    path = tmp_path / 'm.py'
    path.write_text(f'class C:\n    def f(self):\n{body}\n\ndef g():\n    pass\n')
    assert long_functions(path) == [('C.f', FUNCTION_LINES + 1)]
