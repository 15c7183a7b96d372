//! Directories and files in a target's world, reached only through a
//! [`TargetRoot`] descriptor (openat2 `RESOLVE_IN_ROOT`): a symlink inside the
//! target (`/tmp -> /`, `out -> /etc`) resolves against the target's root,
//! never the host's. Used for msprof's output directory and for finding
//! msprof itself.
use std::io;

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Uid};

use super::rootfs::TargetRoot;

/// Who owns what dynprof creates in the target's world (host ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

fn components(path: &str) -> Vec<&str> {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect()
}

fn join(cur: &[String]) -> String {
    format!("/{}", cur.join("/"))
}

/// `path` with every symlink resolved inside the target's root: the path a
/// process in the target would end up at (absolute, no `.`/`..`).
pub fn canonical(root: &TargetRoot, path: &str) -> io::Result<String> {
    let mut todo: Vec<String> = components(path)
        .into_iter()
        .rev()
        .map(String::from)
        .collect();
    let mut cur: Vec<String> = Vec::new();
    let mut links = 0;
    while let Some(c) = todo.pop() {
        if c == ".." {
            cur.pop();
            continue;
        }
        cur.push(c);
        let fd = root.open_with(&join(&cur), OFlags::PATH | OFlags::NOFOLLOW, Mode::empty())?;
        if FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode) == FileType::Symlink {
            links += 1;
            if links > 40 {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            cur.pop();
            let dest = rustix::fs::readlinkat(&fd, "", Vec::new())?;
            let dest = dest.to_string_lossy().into_owned();
            if dest.starts_with('/') {
                cur.clear();
            }
            todo.extend(components(&dest).into_iter().rev().map(String::from));
        }
    }
    Ok(join(&cur))
}

/// True when `path` (followed inside the root) is a regular file with an
/// execute bit.
pub fn is_executable_file(root: &TargetRoot, path: &str) -> bool {
    root.open_with(path, OFlags::PATH, Mode::empty())
        .and_then(|fd| Ok(rustix::fs::fstat(&fd)?))
        .is_ok_and(|st| {
            FileType::from_raw_mode(st.st_mode) == FileType::RegularFile && st.st_mode & 0o111 != 0
        })
}

/// What [`ensure_dir`] found or made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetDir {
    /// The canonical path inside the target's root.
    pub path: String,
    /// True when dynprof created it (else it existed, owned by the owner).
    pub created: bool,
}

fn eexist(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EEXIST)
}

/// Makes directory `name` in `parent_fd` (no link followed for `name`), and
/// hands it to `owner`.
fn mkdir_owned(
    parent: &rustix::fd::OwnedFd,
    name: &str,
    mode: u32,
    owner: Owner,
) -> io::Result<()> {
    rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(mode))?;
    let fd = rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rustix::fs::fchown(
        &fd,
        Some(Uid::from_raw(owner.uid)),
        Some(Gid::from_raw(owner.gid)),
    )?;
    // The umask may have trimmed the mode.
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
    Ok(())
}

/// Makes sure `path` is a directory in the target's world that `owner` owns:
/// missing components are created (mode 0750 for the last, 0755 above), as
/// `owner`; an existing last directory owned by anyone else is refused.
/// With `fresh`, the last component must not exist yet.
pub fn ensure_dir(
    root: &TargetRoot,
    path: &str,
    owner: Owner,
    fresh: bool,
) -> Result<TargetDir, String> {
    let comps = components(path);
    if comps.is_empty() || comps.contains(&"..") {
        return Err(format!(
            "{path:?}: need an absolute directory path without `..`"
        ));
    }
    let mut created = false;
    for i in 0..comps.len() {
        let prefix = format!("/{}", comps[..=i].join("/"));
        let last = i + 1 == comps.len();
        if !(last && fresh) {
            match root.open_dir(&prefix) {
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(format!("{prefix} in the target's root: {e}")),
            }
        }
        let parent = format!("/{}", comps[..i].join("/"));
        let pfd = root
            .open_dir(&parent)
            .map_err(|e| format!("{parent} in the target's root: {e}"))?;
        match mkdir_owned(&pfd, comps[i], if last { 0o750 } else { 0o755 }, owner) {
            Ok(()) => created |= last,
            // A racing creator: judged below like any existing directory.
            Err(e) if eexist(&e) && !(last && fresh) => {}
            Err(e) => return Err(format!("creating {prefix} in the target's root: {e}")),
        }
    }
    let fd = root
        .open_dir(path)
        .map_err(|e| format!("{path} in the target's root: {e}"))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("{path}: {e}"))?;
    if st.st_uid != owner.uid {
        return Err(format!(
            "{path} in the target's root is owned by uid {}, not by the job's uid {}; \
             refusing to use it (another user may have created it in advance). Remove it, \
             or pass a directory the job's user owns",
            st.st_uid, owner.uid
        ));
    }
    let canon = canonical(root, path).map_err(|e| format!("{path}: {e}"))?;
    Ok(TargetDir {
        path: canon,
        created,
    })
}

/// The names of the subdirectories of `path` (in the target's root) whose
/// name starts with `prefix`. Symlinks are not directories here.
pub fn list_subdirs(root: &TargetRoot, path: &str, prefix: &str) -> io::Result<Vec<String>> {
    let fd = root.open_dir(path)?;
    let mut out = Vec::new();
    for e in rustix::fs::Dir::read_from(&fd)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with(prefix) {
            continue;
        }
        let ft = match e.file_type() {
            FileType::Unknown => FileType::from_raw_mode(
                rustix::fs::statat(&fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)?.st_mode,
            ),
            t => t,
        };
        if ft == FileType::Directory {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}

/// Regular files directly in `dir` (in the target's root) whose names pass
/// `keep`, with their sizes, sorted by name. Symlinks are not followed.
pub fn list_files(
    root: &TargetRoot,
    dir: &str,
    keep: impl Fn(&str) -> bool,
) -> io::Result<Vec<(String, u64)>> {
    let fd = root.open_dir(dir)?;
    let mut out = Vec::new();
    for e in rustix::fs::Dir::read_from(&fd)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !keep(&name) {
            continue;
        }
        let st = rustix::fs::statat(&fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile {
            out.push((name, st.st_size as u64));
        }
    }
    out.sort();
    Ok(out)
}

/// At most `cap` bytes of the regular file `path` (in the target's root),
/// from `offset` on, read under [`super::rootfs::FILE_DEADLINE`]; with the
/// file's size. A FIFO, device or link out of the root is refused unopened.
pub fn read_capped(
    root: &TargetRoot,
    path: &str,
    offset: u64,
    cap: usize,
) -> io::Result<(Vec<u8>, u64)> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let f = root.open_regular(path)?;
    let size = f.size;
    let mut file = f.file;
    let what = format!("reading {path} in the target's root");
    let bytes = super::rootfs::within(
        super::rootfs::FILE_DEADLINE,
        &what,
        move || -> io::Result<Vec<u8>> {
            file.seek(SeekFrom::Start(offset))?;
            let mut buf = Vec::new();
            file.take(cap as u64).read_to_end(&mut buf)?;
            Ok(buf)
        },
    )??;
    Ok((bytes, size))
}

/// Replaces `dir/name` (in the target's root) with `bytes`, the way an
/// editor saves: a new file under a random name, created `O_EXCL` (never
/// through a link the target planted) in the directory's descriptor, given
/// to `owner` with `mode`, fsynced, then renamed over `name` in that same
/// descriptor. The directory itself is resolved inside the root.
pub fn replace_file(
    root: &TargetRoot,
    dir: &str,
    name: &str,
    bytes: &[u8],
    owner: Owner,
    mode: u32,
) -> io::Result<()> {
    use std::io::Write as _;
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a file name"),
        ));
    }
    let dfd = root.open_dir(dir)?;
    let tmp = super::hostfs::random_name(&format!(".{name}.dynprof"));
    let fd = rustix::fs::openat(
        &dfd,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let r = (|| -> io::Result<()> {
        rustix::fs::fchown(
            &fd,
            Some(Uid::from_raw(owner.uid)),
            Some(Gid::from_raw(owner.gid)),
        )?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
        let mut f = std::fs::File::from(fd);
        f.write_all(bytes)?;
        f.sync_all()?;
        rustix::fs::renameat(&dfd, tmp.as_str(), &dfd, name)?;
        Ok(())
    })();
    if r.is_err() {
        let _ = rustix::fs::unlinkat(&dfd, tmp.as_str(), AtFlags::empty());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt as _, symlink};

    #[test]
    fn dirs_are_made_and_listed_inside_the_root_only() {
        let base = std::env::temp_dir().join(format!("dynprof-targetdir-{}", std::process::id()));
        let host =
            std::env::temp_dir().join(format!("dynprof-targetdir-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&host);
        std::fs::create_dir_all(&host).unwrap();
        std::fs::create_dir_all(host.join("PROF_host")).unwrap();
        let host_s = host.to_str().unwrap();
        // Inside the root: /t -> <host dir>, which the root also has.
        std::fs::create_dir_all(base.join(host_s.trim_start_matches('/'))).unwrap();
        symlink(host_s, base.join("t")).unwrap();
        let root = TargetRoot::open(&base).unwrap();
        assert_eq!(canonical(&root, "/t").unwrap(), host_s);
        assert_eq!(canonical(&root, "/t/./").unwrap(), host_s);
        // `..` after a link climbs from where the link led, as the kernel does.
        let parent = host.parent().unwrap().to_str().unwrap();
        assert_eq!(canonical(&root, "/t/..").unwrap(), parent);
        assert!(canonical(&root, "/t/missing").is_err());
        let me = Owner {
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        };
        let d = ensure_dir(&root, "/t/out/a", me, true).unwrap();
        assert!(d.created);
        assert_eq!(d.path, format!("{host_s}/out/a"));
        let inside = base.join(host_s.trim_start_matches('/')).join("out/a");
        assert!(inside.is_dir());
        assert_eq!(std::fs::metadata(&inside).unwrap().mode() & 0o7777, 0o750);
        // Nothing appeared on the host.
        let names: Vec<_> = std::fs::read_dir(&host)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["PROF_host"]);
        assert!(ensure_dir(&root, "/t/out/a", me, true).is_err(), "fresh");
        assert!(!ensure_dir(&root, "/t/out/a", me, false).unwrap().created);
        std::fs::create_dir(inside.join("PROF_1")).unwrap();
        symlink("/", inside.join("PROF_link")).unwrap();
        assert_eq!(
            list_subdirs(&root, "/t/out/a", "PROF_").unwrap(),
            ["PROF_1"]
        );
        assert_eq!(
            list_subdirs(&root, "/t", "PROF_").unwrap(),
            Vec::<String>::new()
        );
        let other = Owner {
            uid: me.uid + 1,
            gid: me.gid,
        };
        let e = ensure_dir(&root, "/t/out/a", other, false).unwrap_err();
        assert!(e.contains("owned by uid"), "{e}");
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&host);
    }

    #[test]
    fn replace_read_and_list_never_leave_the_root() {
        let base =
            std::env::temp_dir().join(format!("dynprof-targetdir-rw-{}", std::process::id()));
        let host =
            std::env::temp_dir().join(format!("dynprof-targetdir-rw-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&host);
        std::fs::create_dir_all(base.join("job/log")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        let victim = host.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        // The job plants links: at the final name, and at a log name.
        symlink(&victim, base.join("job/profiler_config.json")).unwrap();
        symlink(&victim, base.join("job/log/dp_x.log")).unwrap();
        std::fs::write(
            base.join("job/log/dp_y.log"),
            "Start Dynamic Profiler at 7 step.\n",
        )
        .unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            base.join("job/log/dp_fifo.log"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let root = TargetRoot::open(&base).unwrap();
        let owner = Owner {
            uid: 65534,
            gid: 65534,
        };
        replace_file(&root, "/job", "profiler_config.json", b"{}", owner, 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let meta = std::fs::symlink_metadata(base.join("job/profiler_config.json")).unwrap();
        assert!(meta.file_type().is_file());
        assert_eq!((meta.uid(), meta.mode() & 0o777), (65534, 0o644));
        assert!(replace_file(&root, "/job", "../x", b"", owner, 0o644).is_err());
        // Only the regular log is listed; the link and the FIFO are not.
        let logs = list_files(&root, "/job/log", |n| n.starts_with("dp_")).unwrap();
        assert_eq!(logs, vec![("dp_y.log".to_string(), 34)]);
        let (b, size) = read_capped(&root, "/job/log/dp_y.log", 6, 7).unwrap();
        assert_eq!((b.as_slice(), size), (&b"Dynamic"[..], 34));
        assert!(read_capped(&root, "/job/log/dp_fifo.log", 0, 10).is_err());
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&host);
    }
}
