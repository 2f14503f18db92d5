"""Mutation testing of the CUDA kernels through host execution (issue 25; docs/cuda.md "Mutants").

Each mutant changes one operator in one line of ``mp_wrappers/csrc/cuda/*.cu`` or
``mp_wrappers/csrc/include/mp_wrappers/cuda/*.cuh``; it is compiled with the ``tiny`` host-execution
geometry and the host tests (tests/kernels/test_cuda_host*.py) run against it. A mutant the tests fail on
(or that times out) is *killed*; one they pass is a *survivor*, i.e. a missing test, unless it is
listed in ``EQUIVALENT`` with the reason it cannot change behaviour.

Operators (``generate``):

* ``rel``: ``<`` ``<=`` ``>`` ``>=`` ``==`` ``!=`` to their off-by-one / negated neighbour (loop
  bounds, guards, tails);
* ``arith``: binary ``+`` <-> ``-`` (offsets, chunk-size arithmetic, the update rules);
* ``logic``: ``&&`` <-> ``||``;
* ``swap``: the two arguments of ``fsub`` / ``fdiv`` (the update rules' non-commutative steps);
* ``skip``: ``skip_update(x)`` -> ``false`` (a dropped found_inf check);
* ``unscale``: ``make_unscale(x)`` -> ``make_unscale(nullptr)`` (a dropped grad_scale);
* ``flag``: ``launch_increment_step(step, x)`` -> with ``nullptr`` (a step counted on overflow).

Never the working tree: every mutant is written under ``--workdir`` (default build/mutants), and
only its translation units are compiled again (the flags and the other objects come from the
tree's own ``build/cuda_host/tiny``, which is built first when absent); the module is linked there
and the tests import it through ``MP_WRAPPERS_CUDA_HOST_MODULE`` (tests/cuda_host.py).
A mutant of a ``.cu`` file recompiles that file; one of a ``.cuh`` header every file including it.
The recompiled objects get UBSan's array-bounds check (``_BOUNDS``).

Usage::

    python tools/cuda_mutants.py --list                 # every mutant, no build
    python tools/cuda_mutants.py --files cu --sample 12 --seed 0  # CI: a fixed sample (455 s)
    python tools/cuda_mutants.py                        # all of them (hours)
    python tools/cuda_mutants.py --only ID [--only ID]  # chosen mutants

The report (``--report``, default build/mutants/report.md) lists every mutant run with killed /
survived / equivalent (with the reason) / does-not-compile. Exit status 1 when a non-equivalent
mutant survived.
"""
import argparse
import concurrent.futures
import dataclasses
import hashlib
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, 'mp_wrappers', 'csrc')
KERNEL_DIR = os.path.join(CSRC, 'cuda')
HEADER_DIR = os.path.join(CSRC, 'include', 'mp_wrappers', 'cuda')
TESTS = ['tests/kernels/test_cuda_host.py', 'tests/kernels/test_cuda_host_lean.py',
         'tests/kernels/test_cuda_host_planner.py', 'tests/kernels/test_cuda_host_adam8bit.py']

# Mutants that cannot change what the kernels compute, by id, with the reason.
_TAIL = ('the tail loop runs once more, with i == n: load_one returns 0 for i >= n and store_one '
         'stores nothing, ')
EQUIVALENT: Dict[str, str] = {
    'multi_tensor_l2norm.cu:41:rel:35d6d1eb': _TAIL + 'and 0 adds 0 to the sum of squares and is '
                                              'finite (no found_inf)',
    'multi_tensor_scale.cu:37:rel:70b8d9ee': _TAIL + 'and 0 is finite (no found_inf)',
    'multi_tensor_scale.cu:81:rel:420d481b': _TAIL + 'and 0 is finite in x and y (no found_inf)',
    # multi_tensor_adam8bit.cu: the boundaries of the codes, where both branches give the same code.
    'multi_tensor_adam8bit.cu:51:rel:b389cf53': 'code 2^M (the first normal) decoded as a subnormal '
                                                'is 2^M * 2^(1-B-M) = 2^(1-B), its normal value',
    'multi_tensor_adam8bit.cu:64:rel:50b71e5f': 'a magnitude equal to MAX is clamped to MAX',
    'multi_tensor_adam8bit.cu:66:rel:d9d703f1': 'min_normal encoded as a subnormal rounds to code '
                                                '2^M, its normal code',
    'multi_tensor_adam8bit.cu:188:rel:e5c568d0': 'the lane at i == n of a short block loaded p = g = 0 '
                                                 'and code 0: its new moments are 0 and do not '
                                                 'raise a max that starts at 0 (only an infinite '
                                                 'absmax in the state, which no finite step writes, '
                                                 'would make them NaN)',
    'multi_tensor_adam8bit.cu:250:logic:ba1853d4': 'launch bounds are a register budget for nvcc '
                                                   '(empty in the host build); '
                                                   'tools/check_cuda_compile.sh checks it',
    'multi_tensor_adam8bit.cu:282:rel:61e25f20': 'with size - b0 == 256 both branches give 256',
    'multi_tensor_adam8bit.cu:225:rel:75579f15': 'the scalar encode loop runs once more per half: '
                                                 'element (h * kILP + kILP) * 32 + lane of h == 0 '
                                                 'is element (1 * kILP + 0) * 32 + lane, so it '
                                                 'writes the code h == 1 writes next, the same '
                                                 'value; that of h == 1 is 256 + lane >= n, never '
                                                 'written (the i < n guard)',
}

_REL = {'<': '<=', '<=': '<', '>': '>=', '>=': '>', '==': '!=', '!=': '=='}
# Binary operators as the sources write them (clang-format: one space each side); a template's
# angle brackets, '->', '<<' and unary minus never match.
_BINARY = re.compile(r'(?<=\S) (<=|>=|==|!=|<|>|\+|-|&&|\|\|) (?=\S)')
_CALLS = {'swap': re.compile(r'\b(fsub|fdiv)\('), 'skip': re.compile(r'\bskip_update\('),
          'unscale': re.compile(r'\bmake_unscale\('),
          'flag': re.compile(r'\blaunch_increment_step\(')}


@dataclasses.dataclass
class Mutant:
    path: str      # relative to the repository root
    line: int      # 1-based
    op: str        # operator class
    before: str    # the original line
    after: str     # the mutated line

    @property
    def id(self) -> str:
        h = hashlib.sha1(f'{self.path}\0{self.before}\0{self.after}'.encode()).hexdigest()[:8]
        return f'{os.path.basename(self.path)}:{self.line}:{self.op}:{h}'

    def describe(self) -> str:
        return f'`{self.before.strip()}` -> `{self.after.strip()}`'


def sources() -> List[str]:
    """Every kernel source and header, relative to the repository root, sorted."""
    out = [os.path.join(KERNEL_DIR, f) for f in os.listdir(KERNEL_DIR) if f.endswith('.cu')]
    out += [os.path.join(HEADER_DIR, f) for f in os.listdir(HEADER_DIR) if f.endswith('.cuh')]
    return sorted(os.path.relpath(p, ROOT) for p in out)


def _code_span(line: str) -> int:
    """Where the code of ``line`` ends (a ``//`` comment starts), string literals skipped."""
    in_str = False
    for i, ch in enumerate(line):
        if ch == '"' and (i == 0 or line[i - 1] != '\\'):
            in_str = not in_str
        elif not in_str and line.startswith('//', i):
            return i
    return len(line)


def _in_string(line: str, pos: int) -> bool:
    return line[:pos].count('"') % 2 == 1


def _call_args(line: str, open_paren: int) -> Optional[List[tuple]]:
    """(start, end) of the top-level arguments of the call whose '(' is at open_paren."""
    depth, start, args = 0, open_paren + 1, []
    for i in range(open_paren, len(line)):
        ch = line[i]
        if ch in '([{':
            depth += 1
        elif ch in ')]}':
            depth -= 1
            if depth == 0:
                args.append((start, i))
                return args
        elif ch == ',' and depth == 1:
            args.append((start, i))
            start = i + 1
    return None  # the call continues on the next line


def _host_compiled(lines: List[str]) -> List[bool]:
    """Whether each line is compiled by the host build (not in the nvcc-only branch of an
    ``#ifdef MP_WRAPPERS_CUDA_HOST``), and is code (not a preprocessor line)."""
    out, stack = [], []
    for text in lines:
        s = text.strip()
        if s.startswith('#'):
            if s.startswith(('#ifdef', '#ifndef', '#if ')):
                host = 'MP_WRAPPERS_CUDA_HOST' in s
                stack.append([host, s.startswith('#ifndef') if host else None])
            elif s.startswith('#else') and stack and stack[-1][0]:
                stack[-1][1] = not stack[-1][1]
            elif s.startswith('#endif') and stack:
                stack.pop()
            out.append(False)
            continue
        out.append(not any(h and off for h, off in stack))
    return out


def _real_geometry(lines: List[str]) -> List[bool]:
    """Lines of ``struct RealGeometry`` (not compiled into the tiny geometry the mutants use)."""
    out, inside = [], False
    for text in lines:
        if text.startswith('struct RealGeometry'):
            inside = True
        out.append(inside)
        if inside and text.startswith('};'):
            inside = False
    return out


def generate(paths: Optional[List[str]] = None) -> List[Mutant]:
    """Every mutant of ``paths`` (default: ``sources()``), in file and line order."""
    out = []
    for rel in paths or sources():
        with open(os.path.join(ROOT, rel)) as f:
            lines = f.read().split('\n')
        compiled, real = _host_compiled(lines), _real_geometry(lines)
        for n, text in enumerate(lines, 1):
            if not compiled[n - 1] or real[n - 1] or text.lstrip().startswith(('//', '*')):
                continue
            if 'static_assert' in text:
                continue  # a compile-time check: a mutant fails to compile or changes nothing
            code = text[:_code_span(text)]
            for m in _BINARY.finditer(code):
                if _in_string(code, m.start()):
                    continue
                tok = m.group(1)
                if tok in _REL:
                    op, new = 'rel', _REL[tok]
                elif tok in ('+', '-'):
                    op, new = 'arith', '-' if tok == '+' else '+'
                else:
                    op, new = 'logic', '||' if tok == '&&' else '&&'
                after = text[:m.start(1)] + new + text[m.end(1):]
                out.append(Mutant(rel, n, op, text, after))
            for op, pat in _CALLS.items():
                for m in pat.finditer(code):
                    args = _call_args(code, m.end() - 1)
                    if args is None:
                        continue
                    if op == 'swap' and len(args) == 2:
                        (a0, a1), (b0, b1) = args
                        a, b = code[a0:a1].strip(), code[b0:b1].strip()
                        after = text[:a0] + b + ', ' + a + text[b1:]
                    elif op == 'skip' and len(args) == 1:
                        after = text[:m.start()] + 'false' + text[args[0][1] + 1:]
                    elif op == 'unscale' and len(args) == 1:
                        after = text[:args[0][0]] + 'nullptr' + text[args[0][1]:]
                    elif op == 'flag' and len(args) == 2:
                        after = text[:args[1][0]] + ' nullptr' + text[args[1][1]:]
                    else:
                        continue
                    if after != text:
                        out.append(Mutant(rel, n, op, text, after))
    return out


def sample(mutants: List[Mutant], k: int, seed: int) -> List[Mutant]:
    """A fixed sample of ``k`` mutants, spread over the files: round-robin over the files, each
    file's mutants shuffled with ``seed``."""
    by_file: Dict[str, List[Mutant]] = {}
    for m in mutants:
        by_file.setdefault(m.path, []).append(m)
    rng = random.Random(seed)
    for lst in by_file.values():
        rng.shuffle(lst)
    out, files = [], sorted(by_file)
    rng.shuffle(files)
    while len(out) < k and any(by_file.values()):
        for f in files:
            if by_file[f] and len(out) < k:
                out.append(by_file[f].pop())
    return out


def apply(mutant: Mutant, text: str) -> str:
    """The file ``text`` with ``mutant`` applied (its line must be as generated)."""
    lines = text.split('\n')
    assert lines[mutant.line - 1] == mutant.before, f'{mutant.id}: the source changed'
    lines[mutant.line - 1] = mutant.after
    return '\n'.join(lines)


# ---- building a mutant ------------------------------------------------------------------------------

# The recompiled objects also check array indices (UBSan's bounds check, no preload needed): a loop
# bound mutated past a fixed-size register array (`k <= kILP` over `float r[kILP]`) is undefined
# behaviour that the tiny build may survive by chance; the asan pass of tools/cuda_host_check.sh
# would catch it, and so does this, at no measurable cost.
_BOUNDS = '-fsanitize=bounds -fno-sanitize-recover=bounds'


class Builder:
    """Compiles a mutant's translation units with the flags of the tree's tiny build and links them
    with the tree's other objects into ``workdir/<id>/``."""

    def __init__(self, workdir: str, jobs: int = 2):
        self.workdir, self.jobs = workdir, jobs
        self.tiny = os.path.join(ROOT, 'build', 'cuda_host', 'tiny')
        ninja = os.path.join(self.tiny, 'build.ninja')
        if not os.path.exists(ninja):
            self._build_tiny()
        self.vars, self.objects = self._parse(open(ninja).read())

    @staticmethod
    def _build_tiny():
        # tests/: the host-execution harness is test code (tests/cuda_host.py).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]))
        subprocess.run([sys.executable, '-c', 'import cuda_host; cuda_host.build("tiny")'],
                       check=True, env=env, cwd=ROOT)

    @staticmethod
    def _parse(text: str):
        text = text.replace('$\n', ' ')
        vars_ = dict(re.findall(r'^(\w+) = (.*)$', text, flags=re.M))
        objects = {}  # object file -> source
        for obj, src in re.findall(r'^build (\S+\.o): compile (\S+)$', text, flags=re.M):
            objects[obj.replace('$:', ':')] = src.replace('$:', ':')
        return vars_, objects

    def _units_of(self, mutant: Mutant) -> List[str]:
        """Objects whose translation unit includes the mutated file (ninja's recorded deps)."""
        src = os.path.join(ROOT, mutant.path)
        out = []
        for obj in self.objects:
            deps = subprocess.run(['ninja', '-t', 'deps', obj], cwd=self.tiny, check=True,
                                  capture_output=True, text=True).stdout.split()
            if src in deps:
                out.append(obj)
        assert out, f'{mutant.id}: no object of {self.tiny} includes {src} (rebuild tiny)'
        return out

    def build(self, mutant: Mutant, timeout: float) -> str:
        """The mutant's module file; raises CalledProcessError when it does not compile."""
        d = os.path.join(self.workdir, mutant.id.replace(':', '_'))
        shutil.rmtree(d, ignore_errors=True)
        inc = os.path.join(d, 'include')
        os.makedirs(os.path.join(inc, 'mp_wrappers', 'cuda'))
        src_path = os.path.join(ROOT, mutant.path)
        mutated = apply(mutant, open(src_path).read())
        if mutant.path.endswith('.cuh'):
            with open(os.path.join(inc, 'mp_wrappers', 'cuda', os.path.basename(src_path)),
                      'w') as f:
                f.write(mutated)
        else:
            with open(os.path.join(d, os.path.basename(src_path)), 'w') as f:
                f.write(mutated)
        objs = []
        for obj, src in self.objects.items():
            obj_abs = obj if os.path.isabs(obj) else os.path.join(self.tiny, obj)
            objs.append(obj_abs)
        jobs = []
        for obj in self._units_of(mutant):
            src = self.objects[obj]
            text = open(src).read()
            if mutant.path.endswith('.cu'):
                text = text.replace(src_path, os.path.join(d, os.path.basename(src_path)))
            unit = os.path.join(d, os.path.basename(src))
            with open(unit, 'w') as f:
                f.write(text)
            out = os.path.join(d, os.path.basename(obj))
            jobs.append(f'{self.vars.get("cxx", "c++")} -I{shlex.quote(inc)} '
                        f'{self.vars["cflags"]} {_BOUNDS} -c {shlex.quote(unit)} '
                        f'-o {shlex.quote(out)} {self.vars["post_cflags"]}')
            obj_abs = obj if os.path.isabs(obj) else os.path.join(self.tiny, obj)
            objs[objs.index(obj_abs)] = out
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            for f in [pool.submit(subprocess.run, cmd, shell=True, check=True,
                                  capture_output=True, timeout=timeout, cwd=self.tiny)
                      for cmd in jobs]:
                f.result()
        so = os.path.join(d, 'mp_wrappers_cuda_host_tiny.so')
        cmd = (f'{self.vars.get("cxx", "c++")} {" ".join(shlex.quote(o) for o in objs)} '
               f'{self.vars["ldflags"]} {_BOUNDS} -o {shlex.quote(so)}')
        subprocess.run(cmd, shell=True, check=True, capture_output=True, timeout=timeout,
                       cwd=self.tiny)
        return so


def run_tests(module: str, workdir: str, timeout: float, tests: List[str]) -> tuple:
    """(status, seconds, last line) of the host tests on ``module``: killed or survived."""
    env = dict(os.environ, PYTHONPATH=ROOT, MP_WRAPPERS_CUDA_HOST_MODULE=module,
               MP_WRAPPERS_CUDA_HOST_VARIANTS='tiny',
               # gcov data of the tree's objects go under the workdir, not the tree's build.
               GCOV_PREFIX=os.path.join(workdir, 'gcov'))
    t0 = time.time()
    try:
        # --capture=sys: a sanitizer's report, written to fd 2 before the abort, reaches stderr.
        p = subprocess.run([sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider',
                            '--capture=sys',
                            *tests], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return 'killed', time.time() - t0, f'timeout after {timeout:.0f} s'
    lines = [ln for ln in p.stdout.strip().split('\n') if ln.strip()]
    last = lines[-1] if lines else p.stderr.strip()[-200:]
    if p.returncode == 0:
        return 'survived', time.time() - t0, last
    failed = [ln for ln in lines if ln.startswith(('FAILED', 'ERROR'))]
    if not failed:  # the process died: a sanitizer's or the interpreter's last word
        failed = [ln.strip() for ln in (p.stdout + p.stderr).split('\n')
                  if 'runtime error' in ln or 'Fatal Python error' in ln][:1]
    return 'killed', time.time() - t0, (failed[0] if failed else last)[:200]


def report(results: List[tuple], path: str, header: str) -> None:
    counts: Dict[str, int] = {}
    for _, status, *_ in results:
        counts[status] = counts.get(status, 0) + 1
    with open(path, 'w') as f:
        f.write(f'# CUDA kernel mutants\n\n{header}\n\n')
        f.write(', '.join(f'{k}: {v}' for k, v in sorted(counts.items())) + '\n\n')
        f.write('| mutant | change | result | seconds | detail |\n|---|---|---|---|---|\n')
        for m, status, secs, detail in results:
            change = m.describe().replace('|', '\\|')
            f.write(f'| `{m.id}` | {change} | {status} | {secs:.0f} | '
                    f'{detail.replace("|", "/")} |\n')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--list', action='store_true', help='print the mutants and exit')
    ap.add_argument('--sample', type=int, default=0, help='run a fixed sample of this many')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--only', action='append', default=[], help='run this mutant id')
    ap.add_argument('--workdir', default=os.path.join(ROOT, 'build', 'mutants'))
    ap.add_argument('--report', default=None)
    ap.add_argument('--timeout', type=float, default=300, help='seconds per mutant test run')
    ap.add_argument('--tests', nargs='*', default=TESTS)
    ap.add_argument('--files', choices=['all', 'cu', 'cuh'], default='all',
                    help='mutate kernel files (.cu: one object to rebuild), headers (.cuh: every '
                         'object including it), or both')
    args = ap.parse_args(argv)
    mutants = [m for m in generate()
               if args.files == 'all' or m.path.endswith('.' + args.files)]
    if args.list:
        for m in mutants:
            print(f'{m.id}\t{m.describe()}')
        print(f'{len(mutants)} mutants in {len({m.path for m in mutants})} files', file=sys.stderr)
        return 0
    if args.only:
        chosen = [m for m in mutants if m.id in args.only]
        missing = set(args.only) - {m.id for m in chosen}
        if missing:
            ap.error(f'unknown mutant ids: {sorted(missing)}')
    elif args.sample:
        chosen = sample(mutants, args.sample, args.seed)
    else:
        chosen = mutants
    os.makedirs(args.workdir, exist_ok=True)
    builder = Builder(args.workdir, int(os.environ.get('MAX_JOBS', '2')))
    results, t_start = [], time.time()
    for i, m in enumerate(chosen, 1):
        t0 = time.time()
        if m.id in EQUIVALENT:
            results.append((m, 'equivalent', 0.0, EQUIVALENT[m.id]))
        else:
            try:
                module = builder.build(m, args.timeout)
            except subprocess.CalledProcessError as e:
                err = (e.stderr or b'').decode(errors='replace').strip().split('\n')
                results.append((m, 'does not compile', time.time() - t0,
                                next((ln for ln in err if 'error' in ln), err[-1])[:160]))
            else:
                status, _, detail = run_tests(module, args.workdir, args.timeout, args.tests)
                results.append((m, status, time.time() - t0, detail))
                shutil.rmtree(os.path.dirname(module), ignore_errors=True)
        m_, status, secs, detail = results[-1]
        print(f'[{i}/{len(chosen)}] {status:16s} {secs:5.0f}s {m.id} {m.describe()}', flush=True)
    wall = time.time() - t_start
    header = (f'{len(chosen)} of {len(mutants)} mutants ({"sample of " + str(args.sample) + ", seed " + str(args.seed) if args.sample and not args.only else "chosen" if args.only else "all"}), '
              f'{wall:.0f} s wall, tests: {" ".join(args.tests)}')
    path = args.report or os.path.join(args.workdir, 'report.md')
    report(results, path, header)
    survivors = [m for m, s, *_ in results if s == 'survived']
    print(f'report: {path}; {len(survivors)} non-equivalent survivors; {wall:.0f} s')
    return 1 if survivors else 0


if __name__ == '__main__':
    sys.exit(main())
