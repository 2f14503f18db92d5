"""The repository stands alone: nothing in it cites a file that a clone does not have."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Documents that lived beside the repository while it was written: their facts are in
# docs/semantics.md now.
# (Spelt in pieces, so that this file does not match itself.)
OUTSIDE = re.compile('|'.join(['REFERENCE' + r'\.md', 'STYLE' + r'\.md', 'STYLE' + ' rule',
                               r'\.\.' + '/shared']))
TEXT = ('.py', '.md', '.sh', '.cpp', '.cu', '.cuh', '.h', '.txt', '.toml', '.cfg', '.yml', '.yaml')


def test_nothing_cites_a_file_outside_the_repository():
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith('.') and d not in (
            'build', 'work_dirs', '__pycache__') and not d.endswith('.egg-info')]
        for name in files:
            if not name.endswith(TEXT):
                continue
            path = os.path.join(root, name)
            with open(path, encoding='utf-8', errors='replace') as f:
                for n, line in enumerate(f, 1):
                    if OUTSIDE.search(line):
                        found.append(f'{os.path.relpath(path, REPO)}:{n}: {line.strip()}')
    assert not found, 'cite docs/semantics.md instead:\n' + '\n'.join(found)


def test_cited_sections_of_semantics_exist():
    with open(os.path.join(REPO, 'docs', 'semantics.md'), encoding='utf-8') as f:
        sections = set(re.findall(r'^## (\d+)\.', f.read(), flags=re.M))
    cited = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith('.') and d != 'build']
        for name in files:
            if name.endswith(TEXT):
                with open(os.path.join(root, name), encoding='utf-8', errors='replace') as f:
                    text = f.read()
                for m in re.finditer(r'semantics\.md sections? (\d+)(?: and (\d+))?', text):
                    cited.update(g for g in m.groups() if g)
    assert cited and cited <= sections, sorted(cited - sections)
