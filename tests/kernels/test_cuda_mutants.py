"""The mutant generator of tools/cuda_mutants.py (no build: the mutants themselves run in
``python tools/cuda_mutants.py``, docs/cuda.md "Mutants")."""
import os
import re
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


def test_a_files_own_tests_run_first(mutants):
    by_file = {os.path.basename(m.path): m for m in mutants}
    groups = cm.test_order(by_file['multi_tensor_adam8bit.cu'], cm.TESTS)
    assert groups[0] == ['tests/kernels/test_cuda_host_adam8bit.py']
    assert sorted(groups[0] + groups[1]) == sorted(cm.TESTS)  # a survivor runs every test
    assert cm.test_order(by_file['multi_tensor_lean.cu'], cm.TESTS)[0] == \
        ['tests/kernels/test_cuda_host_lean.py']
    assert cm.test_order(by_file['multi_tensor_apply.cuh'], cm.TESTS)[0] == \
        ['tests/kernels/test_cuda_host_planner.py']
    assert cm.test_order(by_file['multi_tensor_sgd.cu'], cm.TESTS)[0] == \
        ['tests/kernels/test_cuda_host.py']
    # Several own files: the 8-bit SGD kernel's lean entry point dies in the lean file.
    groups = cm.test_order(by_file['multi_tensor_sgd8bit.cu'], cm.TESTS)
    assert groups[0] == ['tests/kernels/test_cuda_host_sgd8bit.py',
                         'tests/kernels/test_cuda_host_sgd8bit_lean.py']
    assert sorted(groups[0] + groups[1]) == sorted(cm.TESTS)
    # Tests chosen with --tests: as given, in one group when the file's own are not among them.
    assert cm.test_order(by_file['multi_tensor_adam8bit.cu'], cm.TESTS[:1]) == [cm.TESTS[:1]]
    own = [t for v in cm.PRIMARY_TESTS.values() for t in ((v,) if isinstance(v, str) else v)]
    assert set(own) <= set(cm.TESTS)
    assert set(cm.PRIMARY_TESTS) <= {os.path.basename(p) for p in cm.sources()}


def test_test_inputs_follow_the_helpers_imported():
    inputs = cm.test_inputs(['tests/kernels/test_cuda_host_adam8bit.py'])
    # test_cuda_host_adam8bit imports test_cuda_host, which imports cuda_host and _guards.
    for rel in ('tests/kernels/test_cuda_host_adam8bit.py', 'tests/kernels/test_cuda_host.py',
                'tests/cuda_host.py', 'tests/_guards.py', 'tests/conftest.py'):
        assert rel in inputs
    assert all(os.path.exists(os.path.join(ROOT, rel)) for rel in inputs)


def _copy_tree(tmp_path, monkeypatch, rels):
    """A repository root under tmp_path holding copies of ``rels``, for outcome_key."""
    for rel in rels:
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(os.path.join(ROOT, rel), 'rb').read())
    monkeypatch.setattr(cm, 'ROOT', str(tmp_path))


def test_results_are_kept_until_a_source_or_test_changes(mutants, tmp_path, monkeypatch):
    m = next(m for m in mutants if m.path.endswith('multi_tensor_sgd.cu') and m.id not in
             cm.EQUIVALENT)
    header = 'mp_wrappers/csrc/include/mp_wrappers/cuda/optim_apply.cuh'
    first, second = 'tests/kernels/test_cuda_host.py', 'tests/kernels/test_cuda_host_lean.py'
    _copy_tree(tmp_path, monkeypatch, [m.path, header, first, second])

    def key_of(tests):
        return cm.outcome_key(m, [m.path, header] + tests)

    key = key_of([first])
    assert key == cm.outcome_key(m, [first, header, m.path, first])  # order, repeats do not count
    other = next(o for o in mutants if o.path == m.path and o.id != m.id)
    assert cm.outcome_key(other, [m.path, header, first]) != key

    results = cm.Results(str(tmp_path / 'results.json'))
    assert cm.outcome(m, results, key_of, [first, second])[0] == 'not run'
    results.put(m.id, key, [first], 'killed', 12.3, 'FAILED tests/...')
    again = cm.Results(str(tmp_path / 'results.json'))  # what the next run reads
    assert cm.outcome(m, again, key_of, [first, second]) == ('killed', 12.3, 'FAILED tests/...')
    assert cm.outcome(m, again, key_of, [second])[0] == 'not run'  # not killed by these tests
    with open(tmp_path / second, 'a') as f:  # a test file that did not kill it: still killed
        f.write('\n')
    assert cm.outcome(m, again, key_of, [first, second])[0] == 'killed'
    for rel in (header, first):  # a header the unit includes, the killing test: stale
        with open(tmp_path / rel, 'a') as f:
            f.write('\n')
        assert cm.outcome(m, again, key_of, [first, second]) == (
            'not run', 0.0, 'its source or tests changed since its run')
    # A survivor holds only for the very tests it passed: one more test file runs it again.
    again.put(m.id, key_of([first]), [first], 'survived', 70.0, '273 passed')
    assert cm.outcome(m, again, key_of, [first])[0] == 'survived'
    assert cm.outcome(m, again, key_of, [first, second])[0] == 'not run'
    # Not compiling depends on no test.
    again.put(m.id, key_of([]), [], 'does not compile', 3.0, 'error: x')
    assert cm.outcome(m, again, key_of, [second])[0] == 'does not compile'
    eq = next(iter(cm.EQUIVALENT))
    eq_m = next(o for o in mutants if o.id == eq)
    assert cm.outcome(eq_m, again, None, [first]) == ('equivalent', 0.0, cm.EQUIVALENT[eq])


def test_report_counts_every_mutant_per_file(mutants, tmp_path):
    sgd = [m for m in mutants if m.path.endswith('multi_tensor_sgd.cu')]
    adam = [m for m in mutants if m.path.endswith('multi_tensor_adam.cu')]
    rows = ([(sgd[0], 'killed', 20.0, 'FAILED x'), (sgd[1], 'survived', 70.0, '273 passed')]
            + [(m, 'not run', 0.0, '') for m in sgd[2:]]
            + [(adam[0], 'does not compile', 3.0, 'error: x')]
            + [(m, 'equivalent', 0.0, 'why') for m in adam[1:]])
    counts = cm.report(rows, str(tmp_path / 'report.md'), 'header')
    assert counts['multi_tensor_sgd.cu'] == {'killed': 1, 'survived': 1, 'equivalent': 0,
                                            'does not compile': 0, 'not run': len(sgd) - 2}
    assert counts['multi_tensor_adam.cu']['equivalent'] == len(adam) - 1
    assert sum(counts['all'].values()) == len(rows)
    text = (tmp_path / 'report.md').read_text()
    assert '| multi_tensor_sgd.cu | %d | 1 | 1 | 0 | 0 | %d |' % (len(sgd), len(sgd) - 2) in text
    assert all(f'`{m.id}`' in text for m, *_ in rows)


def test_a_kill_depends_on_the_failed_tests_file_only(monkeypatch):
    groups = [['tests/kernels/test_cuda_host.py'],
              ['tests/kernels/test_cuda_host_lean.py', 'tests/kernels/test_cuda_host_traffic.py']]
    outputs = iter([(0, '10 passed'), (1, 'FAILED tests/kernels/test_cuda_host_traffic.py::t[tiny]'
                                          '\n1 failed, 5 passed')])

    def fake_run(*args, **kwargs):
        rc, out = next(outputs)
        return cm.subprocess.CompletedProcess(args, rc, out, '')
    monkeypatch.setattr(cm.subprocess, 'run', fake_run)
    status, _, detail, tests = cm.run_tests('m.so', '/tmp', 10, groups)
    assert (status, tests) == ('killed', ['tests/kernels/test_cuda_host_traffic.py'])
    assert detail.startswith('FAILED tests/kernels/test_cuda_host_traffic.py::t')
    # The process died (no test named): the whole group decided it.
    outputs = iter([(-6, 'Fatal Python error: Aborted')])
    assert cm.run_tests('m.so', '/tmp', 10, groups[:1])[3] == groups[0]


def test_inputs_do_not_depend_on_the_checkout(mutants, monkeypatch):
    """The generated wrapper (build/.../src/X.cpp includes the .cu by absolute path) and files
    outside the repository are not inputs: results.json holds in any checkout of the same
    sources."""
    m = next(m for m in mutants if m.path.endswith('multi_tensor_sgd.cu'))
    b = cm.Builder.__new__(cm.Builder)
    root = '/somewhere/else'
    monkeypatch.setattr(cm, 'ROOT', root)
    b.deps = {'sgd.o': [f'{root}/build/cuda_host/tiny/src/multi_tensor_sgd.cpp',
                        f'{root}/{m.path}', '/usr/include/torch/x.h']}
    b.objects = {'sgd.o': f'{root}/build/cuda_host/tiny/src/multi_tensor_sgd.cpp'}
    assert b.inputs(m) == [m.path]


def test_definitions_are_not_mutated_as_calls(mutants):
    """``bool skip_update(const float* found_inf) {`` is no call: its skip / unscale / flag mutant
    would not compile. A definition's swapped parameters are a mutant (every call swapped)."""
    befores = {(m.op, m.before.strip()) for m in mutants}
    for op, name in (('skip', 'skip_update'), ('unscale', 'make_unscale'),
                     ('flag', 'launch_increment_step')):
        assert not any(o == op and re.search(r'\w+ ' + name + r'\(', b) for o, b in befores)
        assert any(o == op and name + '(' in b for o, b in befores)  # the calls still are
    assert any(o == 'swap' and b.startswith('__device__ __forceinline__ float fsub(float a')
               for o, b in befores)


def _put_many(path, prefix, n):
    results = cm.Results(path)
    for i in range(n):
        results.put(f'{prefix}:{i}', 'k', [], 'killed', 1.0, '')


def test_runs_sharing_a_workdir_lose_no_outcome(tmp_path):
    # Two runs on one workdir (one per file, both cores busy) write results.json in turns: each
    # put reads, adds and replaces the file under a lock, so neither drops the other's outcomes.
    import multiprocessing
    path = str(tmp_path / 'results.json')
    ctx = multiprocessing.get_context('fork')
    procs = [ctx.Process(target=_put_many, args=(path, name, 40)) for name in ('a', 'b')]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = cm.Results(path).data
    assert sorted(data) == sorted(f'{x}:{i}' for x in 'ab' for i in range(40))
