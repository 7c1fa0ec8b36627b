#!/usr/bin/env bash
# The compatibility subset (pytest -m compat: every private torch API and FSDP2 behaviour dmuon relies on,
# plus the main equivalence cases) on other torch releases, one virtual environment per release.
#   scripts/compat.sh 2.14.1 2.11.0        # each: a venv with that torch, dmuon (-e ".[test]"), the subset
#   scripts/compat.sh --install-only 2.11.0
# Environment: DMUON_COMPAT_VENVS (where the venvs live; default .venv-compat/ in the repository),
# DMUON_COMPAT_FIND_LINKS (a folder of wheels pip may take torch and its dependencies from; default
# /opt/pypi-more/files where it exists), PYTHON (the interpreter the venvs are made from; default python3),
# DMUON_COMPAT_TIMEOUT (seconds the subset may take per release; default 1800).
# A pip configuration that caps torch (a `constraint` file, as some machines set up) does not apply in these
# venvs: each pins its own torch, and a cap below it would refuse the release asked for.
# A release that cannot be installed fails the command (exit 1); it is never skipped. Exit status: 0 every
# release installed and passed, 1 an install or a test failed, 2 usage. Each release's pytest output is kept
# in <venv>/compat.log; the last lines printed are one summary line per release.
set -euo pipefail
cd "$(dirname "$0")/.."

install_only=0
versions=()
for arg in "$@"; do
    case "$arg" in
        --install-only) install_only=1 ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "compat.sh: unknown option $arg" >&2; exit 2 ;;
        *) versions+=("$arg") ;;
    esac
done
if [ ${#versions[@]} -eq 0 ]; then
    echo "usage: scripts/compat.sh [--install-only] TORCH_VERSION... (e.g. 2.14.1 2.11.0)" >&2
    exit 2
fi

venvs=${DMUON_COMPAT_VENVS:-.venv-compat}
python=${PYTHON:-python3}
links=()
find_links=${DMUON_COMPAT_FIND_LINKS-/opt/pypi-more/files}
if [ -n "$find_links" ] && [ -d "$find_links" ]; then
    links=(--find-links "$find_links")
fi
mkdir -p "$venvs"
# An empty constraint file in place of the ones pip's configuration names (an empty PIP_CONSTRAINT
# does not replace them); the -c below still applies.
export PIP_CONSTRAINT=/dev/null
summary=()
failed=0

fail_install() {
    echo "compat.sh: torch $1: $2" >&2
    exit 1
}

for version in "${versions[@]}"; do
    venv="$venvs/torch-$version"
    echo "== torch $version: $venv"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || fail_install "$version" "could not create the venv $venv"
    vpy="$venv/bin/python"
    # torch first, on its own: then dmuon's install sees it in place and the constraint keeps it there,
    # whatever dmuon's declared range says (a release outside the range then fails to install, loudly).
    "$vpy" -m pip install --quiet "${links[@]}" "torch==$version" \
        || fail_install "$version" "pip could not install torch==$version"
    constraint="$venv/torch-constraint.txt"
    echo "torch==$version" > "$constraint"
    "$vpy" -m pip install --quiet "${links[@]}" -c "$constraint" -e ".[test]" \
        || fail_install "$version" "pip could not install dmuon[test] beside torch $version"
    got=$("$vpy" -c 'import torch; print(torch.__version__.split("+")[0])') \
        || fail_install "$version" "torch does not import in $venv"
    [ "$got" = "$version" ] || fail_install "$version" "the venv holds torch $got after installing dmuon"
    if [ "$install_only" = 1 ]; then
        summary+=("torch $version: installed")
        continue
    fi
    log="$venv/compat.log"
    start=$(date +%s)
    set +e
    timeout "${DMUON_COMPAT_TIMEOUT:-1800}" "$vpy" -m pytest -q -p no:cacheprovider -m compat -rfEs 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    seconds=$(( $(date +%s) - start ))
    # pytest's last line: "26 passed, 1125 deselected in 55.34s" (-q), with "=" around it otherwise.
    counts=$( (grep -E '(passed|failed|error|no tests ran)' "$log" || true) | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    [ "$rc" -eq 124 ] && counts="timed out after ${DMUON_COMPAT_TIMEOUT:-1800} s; $counts"
    summary+=("torch $version: rc=$rc, ${counts:-no pytest summary}, ${seconds} s (log: $log)")
    [ "$rc" -eq 0 ] || failed=1
done

echo "== compatibility subset (pytest -m compat)"
printf '%s\n' "${summary[@]}"
exit "$failed"
