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
    python tools/cuda_mutants.py --files cu --sample 6 --seed 0  # CI: a fixed sample (~440 s, Zen 3)
    python tools/cuda_mutants.py                        # all of them (hours)
    python tools/cuda_mutants.py --only ID [--only ID]  # chosen mutants
    python tools/cuda_mutants.py --file multi_tensor_sgd.cu  # one file's mutants
    # Both cores busy: a test run uses one, so two runs on disjoint files, one build job each,
    # share the workdir (results.json is written under a lock) and finish sooner than one.
    MAX_JOBS=1 python tools/cuda_mutants.py --files cu & MAX_JOBS=1 python tools/cuda_mutants.py --files cuh

Resumable: every outcome goes into ``--workdir``/results.json, keyed by the mutant id and a digest of
what decides it (``outcome_key``: the files of the recompiled translation units, the host-test files
and the test helpers they import, the tool's build flags). A run takes a mutant's outcome from there
when its key still matches and runs it otherwise, so an interrupted full run goes on where it
stopped, and a changed source or test re-runs exactly the mutants it concerns; ``--fresh`` runs them
all again. (The oracles, the CPU extension and the references, are not in the key.)

Killing fast: the tests of the mutated file's own kernel run first (``PRIMARY_TESTS``), then the
others, each with ``-x``; a survivor has run every test.

The report (``--report``, default build/mutants/report.md) is written from the results for every
mutant of ``--files``: killed / survived / equivalent (with the reason) / does not compile / not run,
per file and per mutant. Exit status 1 when a mutant of this run survived (not equivalent).
"""
import argparse
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, 'mp_wrappers', 'csrc')
KERNEL_DIR = os.path.join(CSRC, 'cuda')
HEADER_DIR = os.path.join(CSRC, 'include', 'mp_wrappers', 'cuda')
TESTS = ['tests/kernels/test_cuda_host.py', 'tests/kernels/test_cuda_host_lean.py',
         'tests/kernels/test_cuda_host_planner.py', 'tests/kernels/test_cuda_host_adam8bit.py',
         'tests/kernels/test_cuda_host_alignment.py', 'tests/kernels/test_cuda_host_traffic.py',
         'tests/kernels/test_cuda_host_boundaries.py',
         'tests/kernels/test_cuda_host_lean_traffic.py',
         'tests/kernels/test_cuda_host_adam8bit_lean.py',
         'tests/kernels/test_cuda_host_adam8bit_edges.py',
         'tests/kernels/test_cuda_host_optim_traffic.py',
         'tests/kernels/test_cuda_host_param_limit.py',
         'tests/kernels/test_cuda_host_nonfinite.py',
         'tests/kernels/test_cuda_host_partials.py',
         'tests/kernels/test_cuda_host_sgd8bit.py',
         'tests/kernels/test_cuda_host_sgd8bit_lean.py']
# The host tests that exercise a file's code (one file or several), run first (most of its mutants
# die there); a file not named here starts with test_cuda_host.py, which calls every other kernel.
PRIMARY_TESTS = {'multi_tensor_adam8bit.cu': 'tests/kernels/test_cuda_host_adam8bit.py',
                 'multi_tensor_sgd8bit.cu': ('tests/kernels/test_cuda_host_sgd8bit.py',
                                             'tests/kernels/test_cuda_host_sgd8bit_lean.py'),
                 'quant_block.cuh': 'tests/kernels/test_cuda_host_adam8bit.py',
                 'quant_lean_param.cuh': ('tests/kernels/test_cuda_host_adam8bit_lean.py',
                                          'tests/kernels/test_cuda_host_sgd8bit_lean.py'),
                 'multi_tensor_lean.cu': 'tests/kernels/test_cuda_host_lean.py',
                 'lean_param.cuh': 'tests/kernels/test_cuda_host_lean.py',
                 'multi_tensor_apply.cuh': 'tests/kernels/test_cuda_host_planner.py',
                 'geometry.cuh': 'tests/kernels/test_cuda_host_planner.py',
                 'runtime.cuh': 'tests/kernels/test_cuda_host_param_limit.py'}

# Mutants that cannot change what the kernels compute, by id, with the reason.
_TAIL = ('the tail loop runs once more, with i == n: load_one returns 0 for i >= n and store_one '
         'stores nothing, ')
EQUIVALENT: Dict[str, str] = {
    'multi_tensor_l2norm.cu:41:rel:35d6d1eb': _TAIL + 'and 0 adds 0 to the sum of squares and is '
                                              'finite (no found_inf)',
    'multi_tensor_scale.cu:37:rel:70b8d9ee': _TAIL + 'and 0 is finite (no found_inf)',
    'multi_tensor_scale.cu:81:rel:420d481b': _TAIL + 'and 0 is finite in x and y (no found_inf)',
    # quant_block.cuh (the 8-bit kernels' codes): the boundaries, where both branches give the same
    # code.
    'quant_block.cuh:40:rel:80441451': 'code 2^M (the first normal) decoded as a subnormal '
                                                'is 2^M * 2^(1-B-M) = 2^(1-B), its normal value',
    'quant_block.cuh:52:rel:a843350a': 'a magnitude equal to MAX is clamped to MAX',
    'quant_block.cuh:54:rel:fd00aefa': 'min_normal encoded as a subnormal rounds to code '
                                                '2^M, its normal code',
    'quant_block.cuh:59:arith:b97ae195': '+ kRebase instead of - kRebase adds 2 * kRebase, a '
                                         'multiple of 256 for both codes (2 * 896 = 7 * 256, '
                                         '2 * 768 = 6 * 256), and the code is the low byte',
    'multi_tensor_adam8bit.cu:172:rel:e5c568d0': 'the lane at i == n of a short block loaded p = g = 0 '
                                                 'and code 0: its new moments are 0 and do not '
                                                 'raise a max that starts at 0 (only an infinite '
                                                 'absmax in the state, which no finite step writes, '
                                                 'would make them NaN)',
    'quant_block.cuh:108:logic:4e2f9ee0': 'launch bounds are a register budget for nvcc '
                                                   '(empty in the host build); '
                                                   'tools/check_cuda_compile.sh checks it',
    'quant_block.cuh:86:arith:45a69305': 'the vector layout\'s index is used with j == 0 '
                                                   '(a pack\'s first element, where + j and - j '
                                                   'agree) and in the absmax guard `< b.n`, where '
                                                   'the vector path has b.n == 256 '
                                                   '(adam8bit_kernel passes `vector` only then) and '
                                                   'both indices (0..255, -3..252) are below it',
    'optim_apply.cuh:113:rel:7b4c2f91': 'the state pointer loop runs once more: state has S + 1 '
                                        'slots and state[S] gets addresses[N - 1] (the model '
                                        'copy\'s list, in bounds) but is never read: every use '
                                        'loops k < S',
    'optim_apply.cuh:151:rel:2c61dc71': 'the guarded path\'s strided loop runs once more when n '
                                        'is a multiple of its stride, with every i >= n: '
                                        'load_one returns 0 (no load), store_one stores nothing, '
                                        'and the ops\' update is a pure function of its lanes '
                                        '(no flag, no counter): nothing observable changes',
    # compute(): s and rs have S + 1 slots (no zero-length array for S == 0); the ops read and
    # write s[0..S-1] only (adam s[0], s[1]; lamb s[0], s[1]; adagrad, novograd and SGD with
    # momentum s[0]; SGD without momentum none), and rs[S] is never loaded or stored.
    'optim_apply.cuh:183:rel:54bb612e': 'the copy into the op\'s slots runs once more: s[S] = '
                                        'rs[S][j], both in bounds, and no op reads s[S]',
    'optim_apply.cuh:186:rel:f1188f09': 'the copy back runs once more: rs[S][j] = s[S], both in '
                                        'bounds, and rs[S] is never stored (every store loops '
                                        'k < S)',
    'multi_tensor_apply.cuh:59:rel:05503f0f': 'a chunk\'s size min(left, kChunk): with left == '
                                              'kChunk both branches give kChunk',
    'multi_tensor_apply.cuh:91:rel:064531bb': 'blocks_per_launch with per == resident: rounding '
                                              'per up to a multiple of resident leaves it as it is',
    'multi_tensor_apply.cuh:102:logic:88dabc23': 'an assertion on for_each_launch\'s callers: '
                                                 'with || it never fails, and no caller passes a '
                                                 'max_blocks outside 1..kMaxBlocks (the && form '
                                                 'is held by the other two mutants of the line)',
    'multi_tensor_apply.cuh:282:arith:6b574a8a': 'NanMaxOp\'s NaN branch: with a NaN operand a + b '
                                                 'and a - b are the same NaN (IEEE 754 returns '
                                                 'the NaN operand, quieted, sign unchanged, on '
                                                 'x86; CUDA returns its canonical NaN for both)',
    'multi_tensor_apply.cuh:282:rel:737c0a0a': 'NanMaxOp with a == b returns a instead of b, the '
                                               'same bits: both users reduce values that are '
                                               'never -0 (NovoGrad fabsf(g) and 0.0; the 8-bit '
                                               'absmax fabsf(m) and v = fma((1 - b2) * g, g, '
                                               'v_old * v_fac) with v_old, v_fac >= +0, from '
                                               '0.f), so equal '
                                               'operands are equal bit patterns',
    'multi_tensor_apply.cuh:296:rel:b3ee76ab': 'block_reduce\'s second stage by every warp but '
                                               'the first instead of the first: each reads the '
                                               'same per-warp values from shared memory, reduces '
                                               'them in the same order and lane 0 writes the '
                                               'same value to shared[0] before the barrier; the '
                                               'same bits, only redundant work on a GPU (shared '
                                               'memory, which the host build does not count). '
                                               'A one-warp block (no such launch reduces) would '
                                               'keep its first stage, equal but for -0 + 0',
    'multi_tensor_sgd8bit.cu:147:rel:1b33dbf7': 'the lane at i == n of a short block loaded p = g = 0 '
                                                'and no code (code value 0): its new buffer '
                                                'value is 0 (d = 0 on the first update, else '
                                                'fma(0, fac, (1 - dampening) * 0) with a finite '
                                                'fac; unscaled, 0 stays 0 for every grad_scale '
                                                'but 0, which no scaler holds) and does not '
                                                'raise a max that starts at 0',
    'multi_tensor_sgd8bit.cu:223:rel:e942c60d': 'with size - b0 == 256 both branches give 256',
    'multi_tensor_adam8bit.cu:270:rel:61e25f20': 'with size - b0 == 256 both branches give 256',
    'multi_tensor_adam8bit.cu:207:rel:75579f15': 'the scalar encode loop runs once more per half: '
                                                 'element (h * kILP + kILP) * 32 + lane of h == 0 '
                                                 'is element (1 * kILP + 0) * 32 + lane, so it '
                                                 'writes the code h == 1 writes next, the same '
                                                 'value; that of h == 1 is 256 + lane >= n, never '
                                                 'written (the i < n guard)',
}

# The tiny geometry's tensors per launch: the host tests' launch configuration, not kernel logic.
# The module reports it (cuda_host/module.cpp, compiled from the same header) and the planner tests
# derive the launches they expect from the report; another value is another valid test rig.
# RealGeometry, the one nvcc builds, is never mutated (``_real_geometry``).
_TINY_DEPTHS = ('TinyGeometry::max_tensors: the host tests\' launch configuration, not kernel '
                'logic (reported by cuda_host/module.cpp from the same header; the planner tests '
                'expect the launches of the reported value); %s is another valid rig')
EQUIVALENT.update({
    'geometry.cuh:35:rel:ed79cf39': _TINY_DEPTHS % '4 tensors per launch at depth 1',
    'geometry.cuh:35:rel:63926e23': _TINY_DEPTHS % '3 tensors per launch at depth 3',
})

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


def _declares(line: str, start: int) -> bool:
    """Whether the name at ``start`` is a function's definition or declaration (its return type
    before it: ``bool skip_update(const float* found_inf) {``), not a call: a ``skip``, ``unscale``
    or ``flag`` mutant there does not compile. (A ``swap`` there is a real mutant: the definition's
    parameters swapped swap every call's arguments.)"""
    before = re.search(r'([\w>&*]+)\s+$', line[:start])
    return before is not None and before.group(1) not in ('return', 'else', 'case')


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
                    if args is None or (op != 'swap' and _declares(code, m.start())):
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

# Parsing torch's headers is most of a unit's compile time (docs/cuda_mutants.md: 18 s -> 7 s a
# unit), and a header mutant compiles up to ten units: they come precompiled, once per workdir and
# flags. Only into units that include runtime.cuh, which includes these two before any header of
# ours, so the prefix changes no unit's meaning (the torch headers are guarded: the unit's own
# includes of them are then empty). The mutated files are never in it.
_PCH_HEADERS = ('ATen/core/Tensor.h', 'torch/library.h')
_PCH_USER = 'mp_wrappers/cuda/runtime.cuh'


class Builder:
    """Compiles a mutant's translation units with the flags of the tree's tiny build and links them
    with the tree's other objects into ``workdir/<id>/``."""

    def __init__(self, workdir: str, jobs: int = 2):
        self.workdir, self.jobs = workdir, jobs
        self.tiny = os.path.join(ROOT, 'build', 'cuda_host', 'tiny')
        # Incremental (a no-op when it is up to date): the mutants link its other objects, and its
        # recorded dependencies say which objects a mutated file is compiled into.
        self._build_tiny()
        self.vars, self.objects = self._parse(open(os.path.join(self.tiny, 'build.ninja')).read())
        self.deps = self._deps()
        self._pch: Optional[str] = None

    def pch(self, timeout: float) -> Optional[str]:
        """The precompiled torch headers' prefix file (built on first use, kept in the workdir under
        a digest of the flags); None when they do not compile (the units then parse them)."""
        if self._pch is None:
            flags = f'{self.vars.get("cxx", "c++")} {self.vars["cflags"]} {_BOUNDS}'
            d = os.path.join(self.workdir, 'pch', hashlib.sha1(flags.encode()).hexdigest()[:12])
            header = os.path.join(d, 'torch_headers.h')
            if not os.path.exists(header + '.gch'):
                os.makedirs(d, exist_ok=True)
                with open(header, 'w') as f:
                    f.write(''.join(f'#include <{h}>\n' for h in _PCH_HEADERS))
                tmp = f'{header}.{os.getpid()}.gch'
                p = subprocess.run(f'{flags} -x c++-header {shlex.quote(header)} -o '
                                   f'{shlex.quote(tmp)}', shell=True, capture_output=True,
                                   timeout=timeout, cwd=self.tiny)
                if p.returncode != 0:
                    self._pch = ''
                    return None
                os.replace(tmp, header + '.gch')
            self._pch = header
        return self._pch or None

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

    def _deps(self) -> Dict[str, List[str]]:
        """Object -> the files its translation unit read (ninja's recorded dependencies)."""
        text = subprocess.run(['ninja', '-t', 'deps'], cwd=self.tiny, check=True,
                              capture_output=True, text=True).stdout
        out: Dict[str, List[str]] = {}
        current = None
        for line in text.split('\n'):
            if line and not line[0].isspace():
                current = out.setdefault(line.split(': #deps')[0], [])
            elif line.strip() and current is not None:
                current.append(os.path.normpath(line.strip()))
        return out

    def _units_of(self, mutant: Mutant) -> List[str]:
        """Objects whose translation unit includes the mutated file."""
        src = os.path.join(ROOT, mutant.path)
        out = [obj for obj in self.objects if src in self.deps.get(obj, [])]
        assert out, f'{mutant.id}: no object of {self.tiny} includes {src} (rebuild tiny)'
        return out

    def inputs(self, mutant: Mutant) -> List[str]:
        """The repository's files the mutant's objects are compiled from (its translation units'
        sources and every header they include), relative to the repository root."""
        out = set()
        for obj in self._units_of(mutant):
            for path in self.deps[obj]:
                rel = os.path.relpath(path, ROOT)
                # Not the wrappers tests/cuda_host.py generates under build/: each only includes
                # its .cu (an input) by absolute path, which would tie the key to this checkout.
                if not rel.startswith(('..', 'build' + os.sep)):
                    out.add(rel)
        return sorted(out)

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
            pch = self.pch(timeout) if any(p.endswith(_PCH_USER) for p in self.deps[obj]) else None
            prefix = f'-Winvalid-pch -include {shlex.quote(pch)} ' if pch else ''
            jobs.append(f'{self.vars.get("cxx", "c++")} -I{shlex.quote(inc)} '
                        f'{self.vars["cflags"]} {_BOUNDS} {prefix}-c {shlex.quote(unit)} '
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


def test_order(mutant: Mutant, tests: List[str]) -> List[List[str]]:
    """``tests`` in the groups they run in for ``mutant``: its file's own tests, then the rest."""
    own = PRIMARY_TESTS.get(os.path.basename(mutant.path), TESTS[0])
    first = [t for t in ((own,) if isinstance(own, str) else own) if t in tests]
    if not first or len(first) == len(tests):
        return [list(tests)]
    return [first, [t for t in tests if t not in first]]


def run_tests(module: str, workdir: str, timeout: float, groups: List[List[str]]) -> tuple:
    """(status, seconds, detail, tests) of the host tests on ``module``, group after group, each
    stopping at its first failure: killed by the first group that fails (``tests``: the file of the
    failed test, or the group when the process died), else survived (``tests``: all of them)."""
    env = dict(os.environ, PYTHONPATH=ROOT, MP_WRAPPERS_CUDA_HOST_MODULE=module,
               MP_WRAPPERS_CUDA_HOST_VARIANTS='tiny',
               # gcov data of the tree's objects go under the workdir, not the tree's build.
               GCOV_PREFIX=os.path.join(workdir, 'gcov'))
    t0, last = time.time(), ''
    for tests in groups:
        try:
            # --capture=sys: a sanitizer's report, written to fd 2 before the abort, reaches stderr.
            p = subprocess.run([sys.executable, '-m', 'pytest', '-x', '-q', '-p',
                                'no:cacheprovider', '--capture=sys', *tests], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 'killed', time.time() - t0, f'timeout after {timeout:.0f} s', tests
        lines = [ln for ln in p.stdout.strip().split('\n') if ln.strip()]
        last = lines[-1] if lines else p.stderr.strip()[-200:]
        if p.returncode == 0:
            continue
        failed = [ln for ln in lines if ln.startswith(('FAILED', 'ERROR'))]
        if not failed:  # the process died: a sanitizer's or the interpreter's last word
            failed = [ln.strip() for ln in (p.stdout + p.stderr).split('\n')
                      if 'runtime error' in ln or 'Fatal Python error' in ln][:1]
        # Killed by a named test: its file alone decides the outcome (tests are independent).
        path = failed[0].split()[1].split('::')[0] if failed and '::' in failed[0] else None
        return ('killed', time.time() - t0, (failed[0] if failed else last)[:200],
                [path] if path in tests else tests)
    return 'survived', time.time() - t0, last, [t for g in groups for t in g]


# ---- the results, kept between runs ----------------------------------------------------------

_IMPORT = re.compile(r'^(?:from|import) (\w+)', flags=re.M)


def test_inputs(tests: List[str]) -> List[str]:
    """``tests`` and the test helpers they import (the modules of tests/, whose every folder is on
    sys.path, and tests/conftest.py), transitively; relative to the repository root, sorted."""
    by_name = {}
    for d, _, files in os.walk(os.path.join(ROOT, 'tests')):
        for f in files:
            if f.endswith('.py'):
                by_name.setdefault(f[:-3], os.path.relpath(os.path.join(d, f), ROOT))
    todo, seen = list(tests) + ['tests/conftest.py'], set()
    while todo:
        rel = todo.pop()
        if rel in seen or not os.path.exists(os.path.join(ROOT, rel)):
            continue
        seen.add(rel)
        todo += [by_name[n] for n in _IMPORT.findall(open(os.path.join(ROOT, rel)).read())
                 if n in by_name]
    return sorted(seen)


def outcome_key(mutant: Mutant, inputs: Iterable[str]) -> str:
    """A digest of what decides ``mutant``'s outcome: its id (file, line, change), the build flags
    it adds and the contents of ``inputs`` (repository-relative paths: the sources of its
    translation units with every header they include, and the test files)."""
    h = hashlib.sha1(f'{mutant.id}\0{mutant.after}\0{_BOUNDS}\0'.encode())
    for rel in sorted(set(inputs)):
        h.update(rel.encode() + b'\0')
        with open(os.path.join(ROOT, rel), 'rb') as f:
            h.update(hashlib.sha1(f.read()).digest())
    return h.hexdigest()


class Results:
    """``workdir``/results.json: mutant id -> {key, tests, status, seconds, detail, when}, written
    after every mutant (an interrupted run loses at most the one it was running).

    ``tests`` are the test files the outcome depends on, and ``key`` covers them: for a killed
    mutant the file of the test that failed, or the group that killed it when the process died
    (tests changed elsewhere cannot revive it), for a survivor every
    test of its run, for one that does not compile none.
    """

    def __init__(self, path: str):
        self.path = path
        self.data: Dict[str, dict] = {}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def get(self, mutant_id: str, key_of, tests: List[str]) -> Optional[dict]:
        """The recorded outcome if it still holds for the current sources and ``tests`` (the test
        files of this run); ``key_of(test_files)`` is the mutant's key with those tests."""
        entry = self.data.get(mutant_id)
        if entry is None:
            return None
        if entry['status'] == 'survived' and sorted(entry['tests']) != sorted(tests):
            return None  # run again: the tests of this run may kill it
        if not set(entry['tests']) <= set(tests):
            return None  # killed by tests this run does not have
        return entry if entry['key'] == key_of(entry['tests']) else None

    def put(self, mutant_id: str, key: str, tests: List[str], status: str, seconds: float,
            detail: str) -> None:
        # Runs on the same workdir (e.g. one per file, to use both cores while a test runs on one)
        # read, add and write under one lock, so none loses another's outcome.
        with open(self.path + '.lock', 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(self.path):
                with open(self.path) as f:
                    self.data = json.load(f)
            self.data[mutant_id] = dict(key=key, tests=sorted(tests), status=status,
                                        seconds=round(seconds, 1), detail=detail,
                                        when=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
            tmp = f'{self.path}.{os.getpid()}.tmp'
            with open(tmp, 'w') as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


STATUSES = ('killed', 'survived', 'equivalent', 'does not compile', 'not run')


def outcome(mutant: Mutant, results: Results, key_of, tests: List[str]) -> tuple:
    """(status, seconds, detail) of ``mutant`` as the results have it (equivalent ones by
    ``EQUIVALENT``); ``not run`` when they have none that still holds (``Results.get``)."""
    if mutant.id in EQUIVALENT:
        return 'equivalent', 0.0, EQUIVALENT[mutant.id]
    entry = results.get(mutant.id, key_of, tests)
    if entry is None:
        stale = mutant.id in results.data
        return 'not run', 0.0, 'its source or tests changed since its run' if stale else ''
    return entry['status'], entry['seconds'], entry['detail']


def report(rows: List[tuple], path: str, header: str) -> Dict[str, Dict[str, int]]:
    """Write the report of ``rows`` (mutant, status, seconds, detail); returns the counts per file
    (and 'all'), status -> number."""
    counts: Dict[str, Dict[str, int]] = {}
    for m, status, *_ in rows:
        for f in (os.path.basename(m.path), 'all'):
            c = counts.setdefault(f, dict.fromkeys(STATUSES, 0))
            c[status] += 1
    with open(path, 'w') as f:
        f.write(f'# CUDA kernel mutants\n\n{header}\n\n')
        f.write('| file | mutants | ' + ' | '.join(STATUSES) + ' |\n'
                + '|---' * (len(STATUSES) + 2) + '|\n')
        for name in sorted(counts, key=lambda n: (n == 'all', n)):
            c = counts[name]
            f.write(f'| {name} | {sum(c.values())} | '
                    + ' | '.join(str(c[s]) for s in STATUSES) + ' |\n')
        f.write('\n| mutant | change | result | seconds | detail |\n|---|---|---|---|---|\n')
        for m, status, secs, detail in rows:
            change = m.describe().replace('|', '\\|')
            f.write(f'| `{m.id}` | {change} | {status} | {secs:.0f} | '
                    f'{detail.replace("|", "/")} |\n')
    return counts


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--list', action='store_true', help='print the mutants and exit')
    ap.add_argument('--sample', type=int, default=0, help='run a fixed sample of this many')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--only', action='append', default=[], help='run this mutant id')
    ap.add_argument('--file', action='append', default=[],
                    help='only the mutants of this kernel file or header (its base name)')
    ap.add_argument('--workdir', default=os.path.join(ROOT, 'build', 'mutants'))
    ap.add_argument('--report', default=None)
    ap.add_argument('--timeout', type=float, default=300, help='seconds per mutant test run')
    ap.add_argument('--tests', nargs='*', default=TESTS)
    ap.add_argument('--fresh', action='store_true',
                    help='run every chosen mutant again, even when results.json has its outcome')
    ap.add_argument('--files', choices=['all', 'cu', 'cuh'], default='all',
                    help='mutate kernel files (.cu: one object to rebuild), headers (.cuh: every '
                         'object including it), or both')
    return ap


def _choose(ap: argparse.ArgumentParser, args, mutants: List[Mutant]) -> List[Mutant]:
    """The mutants this run is for: --file, then --only or --sample."""
    unknown = set(args.file) - {os.path.basename(m.path) for m in mutants}
    if unknown:
        ap.error(f'--file: no mutants in {sorted(unknown)}; allowed: the base names of '
                 f'{sorted({os.path.basename(m.path) for m in mutants})}')
    chosen = [m for m in mutants if not args.file or os.path.basename(m.path) in args.file]
    if args.only:
        chosen = [m for m in chosen if m.id in args.only]
        missing = set(args.only) - {m.id for m in chosen}
        if missing:
            ap.error(f'unknown mutant ids: {sorted(missing)}')
    elif args.sample:
        chosen = sample(chosen, args.sample, args.seed)
    return chosen


def _key_makers(builder: Builder, mutants: List[Mutant]) -> Dict[str, object]:
    """Mutant id -> its key as a function of the test files its outcome depends on."""
    test_files: Dict[tuple, List[str]] = {}

    def key_of(m: Mutant):
        src = builder.inputs(m)

        def key(tests: List[str]) -> str:
            t = tuple(sorted(tests))
            if t not in test_files:
                test_files[t] = test_inputs(list(t)) if t else []
            return outcome_key(m, src + test_files[t])
        return key
    return {m.id: key_of(m) for m in mutants}


def _run_one(m: Mutant, builder: Builder, args) -> tuple:
    """(status, detail, tests its outcome depends on) of building and testing ``m``."""
    try:
        module = builder.build(m, args.timeout)
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b'').decode(errors='replace').strip().split('\n')
        return 'does not compile', next((ln for ln in err if 'error' in ln), err[-1])[:160], []
    except subprocess.TimeoutExpired:
        return 'does not compile', f'build timeout after {args.timeout:.0f} s', []
    status, _, detail, tests = run_tests(module, args.workdir, args.timeout,
                                         test_order(m, args.tests))
    shutil.rmtree(os.path.dirname(module), ignore_errors=True)
    return status, detail, tests


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    mutants = [m for m in generate()
               if args.files == 'all' or m.path.endswith('.' + args.files)]
    if args.list:
        for m in mutants:
            print(f'{m.id}\t{m.describe()}')
        print(f'{len(mutants)} mutants in {len({m.path for m in mutants})} files', file=sys.stderr)
        return 0
    chosen = _choose(ap, args, mutants)
    os.makedirs(args.workdir, exist_ok=True)
    builder = Builder(args.workdir, int(os.environ.get('MAX_JOBS', '2')))
    results = Results(os.path.join(args.workdir, 'results.json'))
    keys = _key_makers(builder, mutants)
    survivors, t_start = 0, time.time()
    for i, m in enumerate(chosen, 1):
        t0, key, note = time.time(), keys[m.id], ''
        if m.id in EQUIVALENT or (not args.fresh and results.get(m.id, key, args.tests)):
            status, secs, detail = outcome(m, results, key, args.tests)
            note = '' if m.id in EQUIVALENT else ' (from results.json)'
        else:
            status, detail, tests = _run_one(m, builder, args)
            secs = time.time() - t0
            results.put(m.id, key(tests), tests, status, secs, detail)
        survivors += status == 'survived'
        print(f'[{i}/{len(chosen)}] {status:16s} {secs:5.0f}s {m.id} {m.describe()}{note}',
              flush=True)
    wall = time.time() - t_start
    what = ('sample of ' + str(args.sample) + ', seed ' + str(args.seed) if args.sample and not
            args.only else 'chosen' if args.only else 'file ' + ', '.join(args.file) if args.file
            else 'all')
    header = (f'This run: {len(chosen)} of {len(mutants)} mutants ({what}), {wall:.0f} s wall, '
              f'{time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, tests: '
              f'{" ".join(args.tests)}. Every mutant of `--files {args.files}` below, as '
              f'{os.path.relpath(results.path, ROOT)} has it (`not run`: no result for its '
              f'current sources and tests).')
    path = args.report or os.path.join(args.workdir, 'report.md')
    counts = report([(m, *outcome(m, results, keys[m.id], args.tests)) for m in mutants], path,
                    header)
    print(f'report: {path}; this run: {survivors} non-equivalent survivors, {wall:.0f} s; all: '
          + ', '.join(f'{s} {counts.get("all", {}).get(s, 0)}' for s in STATUSES))
    return 1 if survivors else 0


if __name__ == '__main__':
    sys.exit(main())
