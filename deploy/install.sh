#!/usr/bin/env bash
# Installs hostd as a systemd service from a bundle (deploy/bundle):
#   deploy/install.sh --bundle BUNDLE [--prefix /opt/slidedp] [--root /] [--enable]
# Copies the bundle to PREFIX, the unit to /etc/systemd/system/slidedp-hostd.service (ExecStart
# pointed at PREFIX), the example config to /etc/slidedp/hostd.toml unless one exists, creates
# the system user and group `slidedp` and runs `systemctl daemon-reload` (and `enable --now`
# with --enable). With --root DIR (not /) everything goes under DIR and no user, group or
# systemctl is touched: a staging tree for packaging, and what the tests check.
# Training jobs run as users in group slidedp (`usermod -aG slidedp USER`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle="" prefix=/opt/slidedp root=/ enable=0
usage() { sed -n 2,10p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while (($#)); do
  case $1 in
    --bundle) bundle=${2:?--bundle needs a directory}; shift 2 ;;
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --enable) enable=1; shift ;;
    -h | --help) usage ;;
    *) echo "install.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n $bundle ]] || { echo "install.sh: --bundle BUNDLE is required (deploy/bundle --build build --out BUNDLE --strip)" >&2; exit 2; }
[[ -x $bundle/bin/hostd ]] || { echo "install.sh: $bundle/bin/hostd not found or not executable; expected a deploy/bundle output" >&2; exit 1; }
[[ $prefix == /* ]] || { echo "install.sh: --prefix must be absolute, got $prefix" >&2; exit 2; }
live=0
[[ $(realpath -m "$root") == / ]] && live=1
if ((live)) && ((EUID != 0)); then
  echo "install.sh: installing into / needs root (or use --root DIR for a staging tree)" >&2
  exit 1
fi
dest=${root%/}$prefix
unit_dir=${root%/}/etc/systemd/system
conf_dir=${root%/}/etc/slidedp
mkdir -p "$dest" "$unit_dir" "$conf_dir"
cp -a "$bundle"/. "$dest"/
[[ -f $here/../README.md ]] && cp "$here/../README.md" "$dest/README.md"
sed -e "s#/opt/slidedp#$prefix#g" "$here/systemd/slidedp-hostd.service" \
  >"$unit_dir/slidedp-hostd.service"
if [[ -e $conf_dir/hostd.toml ]]; then
  echo "kept the existing $conf_dir/hostd.toml"
else
  install -m 0644 "$here/systemd/hostd.toml" "$conf_dir/hostd.toml"
fi
# The configuration must parse with this hostd before the service is (re)started.
"$dest/bin/hostd" --config "$conf_dir/hostd.toml" --print-config >/dev/null
if ((live)); then
  getent group slidedp >/dev/null || groupadd --system slidedp
  getent passwd slidedp >/dev/null ||
    useradd --system --gid slidedp --home-dir /var/lib/slidedp --shell /usr/sbin/nologin slidedp
  systemctl daemon-reload
  if ((enable)); then systemctl enable --now slidedp-hostd.service; fi
fi
echo "installed: $dest/bin/hostd, $unit_dir/slidedp-hostd.service, $conf_dir/hostd.toml"
((live)) && echo "next: edit /etc/slidedp/hostd.toml (model, world_size), then systemctl enable --now slidedp-hostd"
exit 0
