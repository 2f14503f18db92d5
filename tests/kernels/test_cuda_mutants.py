"""The mutant generator of tools/cuda_mutants.py (no build: the mutants themselves run in
``python tools/cuda_mutants.py``, docs/cuda.md "Mutants")."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, 'tools'))
import cuda_mutants as cm  # noqa: E402


@pytest.fixture(scope='module')
def mutants():
    return cm.generate()


def test_every_kernel_file_has_mutants_of_every_kind(mutants):
    files = {m.path for m in mutants}
    assert files == set(cm.sources())
    assert {m.op for m in mutants} == {'rel', 'arith', 'logic', 'swap', 'skip', 'unscale', 'flag'}
    assert len({m.id for m in mutants}) == len(mutants), 'mutant ids must be unique'


def test_each_mutant_changes_one_operator_of_code(mutants):
    for m in mutants:
        assert m.before != m.after
        text = open(os.path.join(ROOT, m.path)).read()
        mutated = cm.apply(m, text)
        # One line differs, and the rest of the file is untouched.
        diff = [(a, b) for a, b in zip(text.split('\n'), mutated.split('\n')) if a != b]
        assert diff == [(m.before, m.after)]
        # Never inside a comment or a string literal, never a preprocessor line.
        code = m.before[:cm._code_span(m.before)]
        assert not m.before.lstrip().startswith(('#', '//'))
        assert m.before[len(code):] == m.after[len(m.after) - (len(m.before) - len(code)):]
        if m.op in ('rel', 'arith', 'logic'):
            assert len(m.after) - len(m.before) in (-1, 0, 1)


def test_known_off_by_ones_are_generated(mutants):
    """The bounds issue 25 names: store_one's guard and the planner's chunk count."""
    descs = {m.describe() for m in mutants}
    assert '`if (i < n) st(p + i, from_float<T>(x));` -> `if (i <= n) st(p + i, from_float<T>(x));`' \
        in descs
    assert any('(numel + chunk - 1) / chunk' in d and '(numel - chunk - 1) / chunk' in d
               for d in descs)  # chunks_of, the planner's chunk count
    assert any(m.op == 'skip' and 'optim_apply.cuh' in m.path for m in mutants)


def test_templates_and_nvcc_only_lines_are_left_alone(mutants):
    assert not any(m.before.lstrip().startswith('template') for m in mutants)
    assert not any('static_assert' in m.before for m in mutants)
    # runtime.cuh's CUDA-runtime branch is compiled by nvcc only: no host check could see it.
    lines = ['#ifdef MP_WRAPPERS_CUDA_HOST', 'a < b;', '#else', 'c < d;', '#endif', 'e < f;']
    assert cm._host_compiled(lines) == [False, True, False, False, False, True]
    lines = ['#ifndef MP_WRAPPERS_CUDA_HOST', 'a < b;', '#else', 'c < d;', '#endif']
    assert cm._host_compiled(lines) == [False, False, False, True, False]


def test_sample_is_deterministic_and_spread(mutants):
    a = [m.id for m in cm.sample(mutants, 13, seed=0)]
    b = [m.id for m in cm.sample(list(mutants), 13, seed=0)]
    assert a == b and len(set(a)) == 13
    assert len({i.split(':')[0] for i in a}) == 13  # one per file before any file gets a second
    assert [m.id for m in cm.sample(mutants, 13, seed=1)] != a


def test_equivalent_mutants_exist_and_have_reasons(mutants):
    """An EQUIVALENT entry names a generated mutant (a changed source line makes it stale)."""
    ids = {m.id for m in mutants}
    assert set(cm.EQUIVALENT) <= ids, sorted(set(cm.EQUIVALENT) - ids)
    assert all(len(reason) > 20 for reason in cm.EQUIVALENT.values())
