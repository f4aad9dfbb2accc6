#!/usr/bin/env bash
# Install the Debian packages the deployment tests need, only when missing:
#   prometheus  -> /usr/bin/prometheus and /usr/bin/promtool (tests/integration/test_prometheus.py,
#                  tests/unit/deploy/test_deploy_manifests.py)
#   haproxy     -> /usr/sbin/haproxy (tests/integration/test_multi_gateway.py)
#   etcd-server -> /usr/bin/etcd (tests/integration/test_etcd_registry.py, test_chaos.py etcd-down)
#   chromium, chromium-driver -> /usr/bin/chromium, /usr/bin/chromedriver (headless browser
#                  for tests/integration/test_dashboard.py, driven by Selenium)
# Idempotent and quiet: does nothing when every tool is present, runs `apt-get update` only
# when a package is missing, and never fails the build (a test whose tool is absent skips
# with the reason). Services are never started here (Debian's policy-rc.d in containers).
set -u

declare -A WANT=([prometheus]=/usr/bin/prometheus [promtool]=/usr/bin/promtool [haproxy]=/usr/sbin/haproxy [redis-server]=/usr/bin/redis-server [chromium]=/usr/bin/chromium [chromedriver]=/usr/bin/chromedriver [etcd]=/usr/bin/etcd)
declare -A PACKAGE_OF=([prometheus]=prometheus [promtool]=prometheus [haproxy]=haproxy [redis-server]=redis-server [chromium]=chromium [chromedriver]=chromium-driver [etcd]=etcd-server)

missing=()
for tool in "${!WANT[@]}"; do
    if [ ! -x "${WANT[$tool]}" ] && ! command -v "$tool" >/dev/null 2>&1; then
        pkg="${PACKAGE_OF[$tool]}"
        case " ${missing[*]-} " in *" $pkg "*) ;; *) missing+=("$pkg") ;; esac
    fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_tools: apt-get not found; tests needing ${missing[*]} will skip" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure_tools: not root; tests needing ${missing[*]} will skip" >&2
        exit 0
    fi
fi
echo "ensure_tools: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq >/dev/null 2>&1 ||
    ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    echo "ensure_tools: could not install ${missing[*]}; the tests needing them will skip" >&2
fi
exit 0
