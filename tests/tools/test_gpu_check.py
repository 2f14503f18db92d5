"""tools/gpu_check.sh's plumbing, on a machine without a GPU: option errors, step selection, the
report and log written as steps end, failures and deadlines reported (the GPU steps themselves run
only on a lent GPU, docs/cuda.md)."""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, 'tools', 'gpu_check.sh')


def _run(tmp_path, **env):
    full = dict(os.environ, GPU_CHECK_OUT=str(tmp_path), **env)
    return subprocess.run(['bash', SCRIPT], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=300)


def test_bad_options_name_the_option_and_the_allowed_values(tmp_path):
    proc = _run(tmp_path, GPU_CHECK_STEPS='build bogus')
    assert proc.returncode == 2
    assert "unknown step 'bogus' in GPU_CHECK_STEPS; steps: build backend cuda-cases" in proc.stderr
    for name in ('GPU_CHECK_STEP_TIMEOUT', 'GPU_CHECK_DEADLINE'):
        proc = _run(tmp_path, **{name: '5m'})
        assert proc.returncode == 2
        assert f"{name} must be a whole number of seconds (0: none), got '5m'" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written for a bad invocation


def test_selected_steps_report_as_they_end(tmp_path):
    """One failing step (no CUDA kernels here), one passing, one cut by the deadline: the report
    and the log are the only two files, the exit status says it failed."""
    proc = _run(tmp_path, GPU_CHECK_STEPS='backend,subnormal-and-norms')
    assert proc.returncode == 1
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith('.log') and files[1].endswith('.md')
    report = (tmp_path / files[1]).read_text()
    assert 'steps: backend subnormal-and-norms' in report
    assert '- **backend**: FAIL (rc 1)' in report
    assert '- **subnormal-and-norms**: pass' in report
    assert report.rstrip().endswith('gpu_check: FAILED')
    log = (tmp_path / files[0]).read_text()
    assert "== backend:" in log and "== subnormal-and-norms:" in log


def test_deadline_skips_and_reports_the_steps_left(tmp_path):
    # The machine report before the first step imports torch three times: well over a second.
    proc = _run(tmp_path, GPU_CHECK_STEPS='backend', GPU_CHECK_DEADLINE='1')
    report = next(tmp_path.glob('*.md')).read_text()
    assert proc.returncode == 1
    assert '- **backend**: SKIPPED, GPU_CHECK_DEADLINE=1 s reached' in report


FAKE_SANITIZER = '''#!/bin/sh
# compute-sanitizer as far as gpu_check.sh uses it: takes --kernel-name unless told not to,
# records the step's command line, runs nothing.
for a in "$@"; do
  case $a in --kernel-name|--kernel-regex|--filter)
    [ "$FAKE_FILTER" = "$a" ] || { echo "unknown option $a" >&2; exit 1; } ;;
  esac
done
[ "$1 $2" = "--tool memcheck" ] || exit 3
case " $* " in *" pytest "*) echo "$*" >> "$FAKE_ARGS" ;; esac
exit 0
'''


def _sanitizer_step(tmp_path, option):
    """Run the sanitizer-memcheck step with a fake compute-sanitizer taking the filter spelled
    ``option`` (another value: none); its process, its one recorded command line, its report."""
    bin_dir, out = tmp_path / 'bin', tmp_path / 'out'
    bin_dir.mkdir()
    out.mkdir()
    fake = bin_dir / 'compute-sanitizer'
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    args = tmp_path / 'args.txt'
    proc = _run(out, GPU_CHECK_STEPS='sanitizer-memcheck', FAKE_FILTER=option,
                FAKE_ARGS=str(args), PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
    assert proc.returncode == 0, proc.stderr
    (line,) = args.read_text().splitlines()
    return proc, line, next(out.glob('*.md')).read_text()


def test_sanitizer_checks_only_our_kernels_where_it_can_filter(tmp_path):
    # memcheck instrumenting the float64 references' torch kernels took ~10 s a case on an H100:
    # the step asks for our kernels only, in whichever spelling the installed release takes.
    _, line, report = _sanitizer_step(tmp_path, '--kernel-regex')
    assert line.startswith('--tool memcheck --kernel-regex kns=mp_wrappers --error-exitcode 1 ')
    assert ' -m pytest -v -x ' in line  # each case named in the log as it starts
    assert '- **sanitizer-memcheck**: pass' in report


def test_sanitizer_without_a_filter_checks_every_kernel_and_says_so(tmp_path):
    proc, line, _ = _sanitizer_step(tmp_path, 'none')
    assert 'compute-sanitizer takes no kernel-name filter: every kernel checked' in proc.stderr
    assert line.startswith('--tool memcheck --error-exitcode 1 ') and 'kns=' not in line
