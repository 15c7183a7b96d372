//! The VM's boot image: the Debian kernel package and busybox, fetched
//! through a private apt state and cached; the initramfs that loads the
//! virtio and 9p modules in dependency order and chroots into the host's root.
use super::*;

/// apt-get with the private state under `cache/apt`.
pub(super) fn apt(cache: &Path) -> Command {
    let a = cache.join("apt");
    let mut c = Command::new("apt-get");
    c.arg("-q")
        .arg(format!(
            "-oDir::Etc::sourcelist={}",
            a.join("sources.list").display()
        ))
        .arg("-oDir::Etc::sourceparts=-")
        .arg(format!("-oDir::State::Lists={}", a.join("lists").display()))
        .arg(format!("-oDir::Cache={}", a.join("cache").display()))
        .arg("-oAPT::Architectures::=amd64")
        .arg("-oAPT::Architectures::=arm64")
        .env("DEBIAN_FRONTEND", "noninteractive");
    c
}

/// Downloads (once) `pkg` into `cache/debs` and returns its .deb.
pub(super) fn download(cache: &Path, pkg: &str, arch: Arch) -> Result<PathBuf> {
    let debs = cache.join("debs");
    let name = pkg.split(':').next().unwrap_or(pkg);
    let find = || -> Result<Option<PathBuf>> {
        if !debs.is_dir() {
            return Ok(None);
        }
        for e in std::fs::read_dir(&debs)? {
            let p = e?.path();
            let f = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if f.starts_with(&format!("{name}_")) && f.ends_with(&format!("_{}.deb", arch.deb())) {
                return Ok(Some(p));
            }
        }
        Ok(None)
    };
    if let Some(p) = find()? {
        return Ok(p);
    }
    std::fs::create_dir_all(&debs)?;
    update_lists(cache)?;
    say(&format!("downloading {pkg}"));
    util::run(apt(cache).current_dir(&debs).args(["download", pkg]))
        .with_context(|| format!("downloading {pkg} (is the kernel version right?)"))?;
    find()?.with_context(|| format!("{pkg} downloaded, but no .deb in {}", debs.display()))
}

/// Writes the private sources (bullseye and bookworm) and updates their
/// lists.
fn update_lists(cache: &Path) -> Result<()> {
    let a = cache.join("apt");
    for d in ["lists/partial", "cache/archives/partial"] {
        std::fs::create_dir_all(a.join(d))?;
    }
    let sources = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bullseye main\n\
                   deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main\n";
    std::fs::write(a.join("sources.list"), sources)?;
    say(&format!(
        "apt-get update (private state in {})",
        a.display()
    ));
    util::run(apt(cache).arg("update")).context(
        "apt-get update of the private bullseye/bookworm sources failed; check access to deb.debian.org",
    )?;
    Ok(())
}

/// Downloads bookworm's arm64 `pkg` with everything it depends on, as if
/// nothing were installed (an empty dpkg status), into `into`; returns the
/// .debs. apt checks every file against the signed lists.
pub(super) fn closure_arm64(cache: &Path, pkg: &str, into: &Path) -> Result<Vec<PathBuf>> {
    update_lists(cache)?;
    std::fs::create_dir_all(into.join("partial"))?;
    let status = into.join("empty-dpkg-status");
    std::fs::write(&status, "")?;
    say(&format!("downloading arm64 {pkg} and its dependencies"));
    util::run(
        apt(cache)
            .arg("-oAPT::Architecture=arm64")
            .arg(format!("-oDir::State::status={}", status.display()))
            .arg(format!("-oDir::Cache::archives={}", into.display()))
            // Our own state only: the host's dpkg lock is not ours to take.
            .arg("-oDebug::NoLocking=1")
            .args([
                "-t",
                "bookworm",
                "--no-install-recommends",
                "--download-only",
            ])
            .args(["-y", "install", pkg]),
    )
    .with_context(|| format!("downloading arm64 {pkg} with its dependencies"))?;
    let mut debs = Vec::new();
    for e in std::fs::read_dir(into)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "deb") {
            debs.push(p);
        }
    }
    debs.sort();
    Ok(debs)
}

/// The unpacked kernel package (boot/ and lib/modules/).
pub(super) fn kernel_package(
    cache: &Path,
    suite: &str,
    version: &str,
    arch: Arch,
) -> Result<PathBuf> {
    let dir = cache
        .join("kernels")
        .join(format!("{version}-{}", arch.deb()));
    if dir.join("boot").is_dir() {
        say(&format!(
            "kernel {version} ({suite}, {}): cached",
            arch.deb()
        ));
        return Ok(dir);
    }
    let pkg = format!(
        "linux-image-{version}-{}-unsigned:{}",
        arch.deb(),
        arch.deb()
    );
    let deb = download(cache, &pkg, arch)?;
    unpack(&deb, &dir)?;
    Ok(dir)
}

pub(super) fn unpack(deb: &Path, dir: &Path) -> Result<()> {
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&tmp))?;
    std::fs::rename(&tmp, dir).with_context(|| format!("renaming into {}", dir.display()))?;
    Ok(())
}

/// A static busybox for the VM's architecture: the host's for x86-64,
/// Debian's busybox-static:arm64 for aarch64.
pub(super) fn busybox_for(cache: &Path, arch: Arch) -> Result<PathBuf> {
    match arch {
        Arch::X86_64 => Ok(PathBuf::from("/bin/busybox")),
        Arch::Aarch64 => {
            let dir = cache.join("busybox-arm64");
            if !dir.join("bin/busybox").is_file() {
                let deb = download(cache, "busybox-static:arm64", arch)?;
                unpack(&deb, &dir)?;
            }
            Ok(dir.join("bin/busybox"))
        }
    }
}

/// Builds (once per kernel) the initramfs: busybox, the modules, `/init`.
pub(super) fn initramfs(
    cache: &Path,
    kdir: &Path,
    release: &str,
    busybox: &Path,
    arch: Arch,
) -> Result<PathBuf> {
    let out = cache.join("initramfs").join(format!("{release}.cpio.gz"));
    let init = init_script();
    let stamp = out.with_extension("init");
    if out.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(init.as_str()) {
        return Ok(out);
    }
    let root = cache.join("initramfs").join(format!("{release}.d"));
    let _ = std::fs::remove_dir_all(&root);
    for d in ["bin", "dev", "proc", "sys", "mnt", "modules"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    std::fs::copy(busybox, root.join("bin/busybox"))
        .with_context(|| format!("copying {}", busybox.display()))?;
    let moddir = kdir.join("lib/modules").join(release);
    let index = module_index(&moddir)?;
    // A module the package does not ship is built into the kernel.
    let wanted: Vec<&str> = MODULES
        .iter()
        .copied()
        .filter(|m| index.contains_key(*m))
        .collect();
    let order = load_order(&wanted, |m| {
        let p = index
            .get(m)
            .with_context(|| format!("module {m}.ko not in {} ({arch:?})", moddir.display()))?;
        module_depends(p)
    })?;
    for m in &order {
        std::fs::copy(
            &index[m.as_str()],
            root.join("modules").join(format!("{m}.ko")),
        )?;
    }
    std::fs::write(root.join("modules/order"), order.join("\n") + "\n")?;
    let init_path = root.join("init");
    std::fs::write(&init_path, &init)?;
    std::fs::set_permissions(
        &init_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    // The host's busybox packs it (the archive format is the same).
    let sh = format!(
        "cd '{}' && find . | /bin/busybox cpio -o -H newc | gzip -1 > '{}'",
        root.display(),
        out.display()
    );
    util::run(Command::new("/bin/sh").arg("-c").arg(&sh)).context("packing the initramfs")?;
    std::fs::write(&stamp, &init)?;
    Ok(out)
}

/// Every `.ko` under `dir` by module name (`-` and `_` are the same).
pub(super) fn module_index(dir: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let e = e?;
            let p = e.path();
            if e.file_type()?.is_dir() {
                stack.push(p);
            } else if let Some(n) = p.file_name().and_then(|f| f.to_str())
                && let Some(stem) = n.strip_suffix(".ko")
            {
                out.insert(stem.replace('-', "_"), p);
            }
        }
    }
    Ok(out)
}

/// The `depends=` list of a module's `.modinfo` (what depmod reads).
pub(super) fn module_depends(ko: &Path) -> Result<Vec<String>> {
    let data = std::fs::read(ko).with_context(|| format!("reading {}", ko.display()))?;
    Ok(depends_in(&data))
}

pub(super) fn depends_in(data: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(at) = data.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let rest = &data[at + KEY.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.replace('-', "_"))
        .collect()
}

/// `wanted` with their dependencies, each after what it depends on.
pub(super) fn load_order(
    wanted: &[&str],
    mut depends: impl FnMut(&str) -> Result<Vec<String>>,
) -> Result<Vec<String>> {
    fn visit(
        m: &str,
        depends: &mut dyn FnMut(&str) -> Result<Vec<String>>,
        seen: &mut Vec<String>,
        out: &mut Vec<String>,
    ) -> Result<()> {
        if seen.iter().any(|s| s == m) {
            return Ok(());
        }
        seen.push(m.to_string());
        for d in depends(m)? {
            visit(&d, depends, seen, out)?;
        }
        out.push(m.to_string());
        Ok(())
    }
    let (mut seen, mut out) = (Vec::new(), Vec::new());
    for m in wanted {
        visit(m, &mut depends, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// `/init`: mount the host root read-only with a tmpfs overlay, the result
/// share at /vm-out, and run /vm-out/cmd.sh with the VM's own busybox (the
/// host's /bin/sh may be of another architecture).
pub(super) fn init_script() -> String {
    r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules/order); do insmod /modules/$m.ko || echo "VM-ERROR insmod $m"; done
mkdir -p /lower /rw /out
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower || echo "VM-ERROR 9p hostroot"
mount -t tmpfs -o size=75% tmpfs /rw; mkdir -p /rw/up /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/up,workdir=/rw/work /mnt || echo "VM-ERROR overlay"
mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=262144 out /out || echo "VM-ERROR 9p out"
mount -t tmpfs tmpfs /mnt/tmp; mount -t tmpfs tmpfs /mnt/run
mount -t proc proc /mnt/proc; mount -t sysfs sys /mnt/sys; mount -t devtmpfs dev /mnt/dev
mkdir -p /mnt/dev/pts /mnt/dev/shm; mount -t devpts devpts /mnt/dev/pts; mount -t tmpfs tmpfs /mnt/dev/shm
mount -t debugfs debugfs /mnt/sys/kernel/debug; mount -t tracefs tracefs /mnt/sys/kernel/tracing 2>/dev/null
mount -t bpf bpf /mnt/sys/fs/bpf 2>/dev/null
mount -t cgroup2 cgroup2 /mnt/sys/fs/cgroup 2>/dev/null
mkdir -p /mnt/vm-out /mnt/vm-bin; mount --bind /out /mnt/vm-out; cp /bin/busybox /mnt/vm-bin/busybox
echo "VM-READY $(cut -d' ' -f1 /proc/uptime)"
chroot /mnt /vm-bin/busybox sh /vm-out/cmd.sh 2>&1 | tee /out/log
sync
echo "VM-DONE $(cut -d' ' -f1 /proc/uptime)"
poweroff -f
"#
    .to_string()
}
