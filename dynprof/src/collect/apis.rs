//! The runtime API tables the `api` collector probes, user-added APIs
//! (`--api OBJECT:SYMBOL[,wait|,collective]`), and their resolution through the
//! target's `/proc/PID/maps` and ELF symbols.
//!
//! An API set names the libraries that may export it (by file-name prefix)
//! and the functions to probe; each library the target maps is searched for
//! every function of its set, and whatever it defines is probed. Nothing is
//! assumed about which CANN library exports what: `libascendcl` and
//! `libacl_rt` are both searched.
use std::{collections::HashMap, path::PathBuf};

use anyhow::{Result, bail};
use serde::Serialize;

use crate::{
    output::model::ApiClass,
    probes::{
        resolve::host_path_for,
        spec::{self, Location, MarkerArg, ObjectRef},
    },
    symbols::{ElfImage, SymbolHit},
    target::{Mapping, Target},
};

/// One function of an API set.
#[derive(Clone, Copy, Debug)]
pub struct ApiDef {
    pub name: &'static str,
    pub class: ApiClass,
}

const fn api(name: &'static str) -> ApiDef {
    ApiDef {
        name,
        class: ApiClass::Call,
    }
}
const fn wait(name: &'static str) -> ApiDef {
    ApiDef {
        name,
        class: ApiClass::DeviceWait,
    }
}
const fn collective_wait(name: &'static str) -> ApiDef {
    ApiDef {
        name,
        class: ApiClass::CollectiveWait,
    }
}

/// A family of runtime APIs and the libraries that may export them.
#[derive(Clone, Copy, Debug)]
pub struct ApiSet {
    pub name: &'static str,
    /// File-name prefixes of the libraries to search (`libcuda.so` matches
    /// `libcuda.so.1` but not `libcudart.so`).
    pub libs: &'static [&'static str],
    pub apis: &'static [ApiDef],
}

/// CANN ACL runtime, op and model APIs.
pub const CANN: ApiSet = ApiSet {
    name: "cann",
    libs: &[
        "libascendcl.so",
        "libacl_rt.so",
        "libascendcl-",
        "libacl_rt-",
    ],
    apis: &[
        api("aclrtLaunchKernel"),
        api("aclrtMemcpy"),
        api("aclrtMemcpyAsync"),
        wait("aclrtSynchronizeStream"),
        wait("aclrtSynchronizeStreamWithTimeout"),
        wait("aclrtSynchronizeDevice"),
        wait("aclrtSynchronizeEvent"),
        api("aclrtRecordEvent"),
        api("aclrtMalloc"),
        api("aclrtFree"),
        api("aclopCompileAndExecute"),
        api("aclmdlExecute"),
    ],
};

/// CUDA runtime (libcudart, also the hashed copies wheels ship, such as
/// `libcudart-d0da41ae.so.11.0`).
pub const CUDA_RUNTIME: ApiSet = ApiSet {
    name: "cuda-runtime",
    libs: &["libcudart.so", "libcudart-"],
    apis: &[
        api("cudaLaunchKernel"),
        api("cudaMemcpy"),
        api("cudaMemcpyAsync"),
        wait("cudaStreamSynchronize"),
        wait("cudaDeviceSynchronize"),
        wait("cudaEventSynchronize"),
        api("cudaMalloc"),
        api("cudaFree"),
    ],
};

/// CUDA driver.
pub const CUDA_DRIVER: ApiSet = ApiSet {
    name: "cuda-driver",
    libs: &["libcuda.so"],
    apis: &[api("cuLaunchKernel")],
};

/// HCCL collectives (Ascend). They enqueue on a stream and return: their
/// host time is the launch; the wait for peers shows in the stream
/// synchronize that follows (device wait) or, on the host, off-CPU.
pub const HCCL: ApiSet = ApiSet {
    name: "hccl",
    libs: &["libhccl.so"],
    apis: &[
        api("HcclAllReduce"),
        api("HcclAllGather"),
        api("HcclReduceScatter"),
        api("HcclBroadcast"),
        api("HcclReduce"),
        api("HcclAlltoAll"),
        api("HcclAlltoAllV"),
        api("HcclSend"),
        api("HcclRecv"),
        api("HcclBarrier"),
    ],
};

/// NCCL collectives (also the copy PyTorch wheels ship under nvidia/nccl).
pub const NCCL: ApiSet = ApiSet {
    name: "nccl",
    libs: &["libnccl.so"],
    apis: &[
        api("ncclAllReduce"),
        api("ncclAllGather"),
        api("ncclReduceScatter"),
        api("ncclBroadcast"),
        api("ncclReduce"),
        api("ncclSend"),
        api("ncclRecv"),
        api("ncclGroupStart"),
        api("ncclGroupEnd"),
    ],
};

/// PyTorch's c10d waits, where a rank's host thread blocks until its peers
/// have joined a collective. On a CPU (gloo) job, DDP waits for the
/// gradient allreduce in `Reducer::finalize_backward` (through an inlined
/// future wait, so the Reducer function is the probe), and a synchronous
/// `dist.all_reduce` in the work's `wait`, which gloo's work does not
/// override except for send and receive. Names are matched demangled,
/// parameters left out; torch 1.13 (Debian) and 2.x (PyPI) export them
/// from `libtorch_cpu.so`.
pub const C10D: ApiSet = ApiSet {
    name: "c10d",
    libs: &["libtorch_cpu.so"],
    apis: &[
        collective_wait("c10d::Reducer::finalize_backward"),
        collective_wait("c10d::Work::wait"),
        collective_wait("c10d::ProcessGroupGloo::SendWork::wait"),
        collective_wait("c10d::ProcessGroupGloo::RecvWork::wait"),
    ],
};

pub const BUILTIN_SETS: &[ApiSet] = &[CANN, CUDA_RUNTIME, CUDA_DRIVER, HCCL, NCCL, C10D];

/// The class of an API of a built-in set (`None`: not in any).
pub fn builtin_class(name: &str) -> Option<ApiClass> {
    BUILTIN_SETS
        .iter()
        .flat_map(|s| s.apis)
        .find(|a| a.name == name)
        .map(|a| a.class)
}

/// A user-added API: `--api OBJECT:SYMBOL[,name=LABEL][,wait|,collective]`,
/// with the object grammar of `--marker` (`exe`, an absolute path in the
/// target, or a library-name fragment). `,wait` classifies its time as
/// device wait, `,collective` as collective wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiSpec {
    pub raw: String,
    pub object: ObjectRef,
    pub symbol: String,
    /// Name in outputs (default: the symbol).
    pub label: String,
    pub class: ApiClass,
}

pub fn parse_api_spec(raw: &str) -> Result<ApiSpec> {
    let s = raw.trim();
    let (s, class) = if let Some(rest) = s.strip_suffix(",wait") {
        (rest, ApiClass::DeviceWait)
    } else if let Some(rest) = s.strip_suffix(",collective") {
        (rest, ApiClass::CollectiveWait)
    } else {
        (s, ApiClass::Call)
    };
    let hint = "hint: --api OBJECT:SYMBOL[,name=LABEL][,wait|,collective], OBJECT = exe | /path/in/target | library-name fragment";
    let m = match spec::parse(s) {
        Ok(MarkerArg::Spec(m)) => m,
        Ok(MarkerArg::Auto) => bail!("--api `{raw}`: `auto` is not an API\n{hint}"),
        Err(e) => bail!("--api `{raw}`: {e:#}"),
    };
    if s.starts_with("python:") || s.starts_with("usdt:") {
        bail!("--api `{raw}`: only function symbols can be traced as APIs\n{hint}");
    }
    let Location::Symbol { name, offset } = m.location else {
        bail!("--api `{raw}`: only function symbols can be traced as APIs\n{hint}");
    };
    if offset != 0 {
        bail!(
            "--api `{raw}`: an API is probed at its entry and return, so it takes no +OFFSET\n{hint}"
        );
    }
    if m.filter.is_some() || m.role != spec::Role::Step {
        bail!(
            "--api `{raw}`: role= and arg=/prefix=/eq= are marker options, not API options\n{hint}"
        );
    }
    Ok(ApiSpec {
        raw: raw.to_string(),
        object: m.object,
        label: m.label.unwrap_or_else(|| name.clone()),
        symbol: name,
        class,
    })
}

/// One probed function in one object.
#[derive(Clone, Debug, Serialize)]
pub struct ResolvedApi {
    /// The attach cookie: index into the collector's API table.
    pub index: u32,
    pub name: String,
    pub class: ApiClass,
    /// Path as the target sees it.
    pub object: String,
    #[serde(skip)]
    pub attach_path: PathBuf,
    pub symbol: String,
    pub file_offset: u64,
}

/// Symbol lookups by (file, inode, symbol, among the exported ones only).
pub type Lookups = HashMap<(String, u64, String, bool), Vec<SymbolHit>>;

/// The API sets' lookups in the libraries a target maps at attach, made
/// ahead of the first arm on a thread of their own and published file by
/// file. A large library takes long (PyTorch 2.x's libtorch_cpu: 0.06 s,
/// 0.15 s in a debug build), and an arm runs on the thread that serves
/// every rank of a job: a slow one there delays the others' plans past
/// their start step.
#[derive(Debug, Default)]
pub struct Prefetch {
    /// (the lookups so far, whether the thread is done)
    state: std::sync::Mutex<(Lookups, bool)>,
    progress: std::sync::Condvar,
}

impl Prefetch {
    /// Starts the lookups of `sets` in what `target` maps now.
    pub fn start(target: &Target, sets: &[ApiSet]) -> std::sync::Arc<Prefetch> {
        let p = std::sync::Arc::new(Prefetch::default());
        let (t, sets, sink) = (target.clone(), sets.to_vec(), p.clone());
        let spawned = std::thread::Builder::new()
            .name("dynprof-api-syms".into())
            .spawn(move || {
                let mut table = ApiTable {
                    sink: Some(sink.clone()),
                    ..ApiTable::default()
                };
                if let Err(e) = resolve(&t, &sets, &[], &mut table, SetLookups::Read) {
                    log::debug!("api: symbol prefetch for PID {}: {e:#}", t.host_pid);
                }
                sink.finish();
            });
        if let Err(e) = spawned {
            // The arm then looks the symbols up itself.
            log::debug!("api: no symbol prefetch thread: {e}");
            p.finish();
        }
        p
    }

    fn publish(&self, key: (String, u64, String, bool), hits: Vec<SymbolHit>) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.0.insert(key, hits);
        self.progress.notify_all();
    }

    fn finish(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.progress.notify_all();
    }

    /// What it has found so far, after waiting at most `bound` for it to
    /// finish, and whether it has.
    pub fn take(&self, bound: std::time::Duration) -> (Lookups, bool) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (mut st, _) = self
            .progress
            .wait_timeout_while(st, bound, |st| !st.1)
            .unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut st.0), st.1)
    }
}

/// Whether [`resolve`] may read a set's library whose lookups are not
/// cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetLookups {
    Read,
    /// No: a [`Prefetch`] is still reading them. Such libraries are left
    /// for a later arm ([`Resolution::deferred`]).
    CachedOnly,
}

/// The collector's API table. Indices are stable for the collector's life:
/// an event read after re-arming still names the right API.
#[derive(Default, Debug)]
pub struct ApiTable {
    entries: Vec<(String, ApiClass)>,
    by_key: HashMap<(String, u64), u32>,
    /// Symbol lookups, kept across arms: the
    /// table is resolved again at every window, and a search of
    /// libtorch_cpu's symbols takes milliseconds. A file replaced on disk
    /// has a new inode and is searched again.
    lookups: Lookups,
    /// Where a [`Prefetch`]'s thread publishes what it finds.
    sink: Option<std::sync::Arc<Prefetch>>,
}

impl ApiTable {
    pub fn name(&self, index: u32) -> Option<(&str, ApiClass)> {
        self.entries
            .get(index as usize)
            .map(|(n, w)| (n.as_str(), *w))
    }

    fn index_for(&mut self, object: &str, file_offset: u64, name: &str, class: ApiClass) -> u32 {
        if let Some(&i) = self.by_key.get(&(object.to_string(), file_offset)) {
            return i;
        }
        let i = self.entries.len() as u32;
        self.entries.push((name.to_string(), class));
        self.by_key.insert((object.to_string(), file_offset), i);
        i
    }

    /// A second name at the same address: both names, and the stronger
    /// class (a wait under either name is a wait).
    fn add_alias(&mut self, object: &str, file_offset: u64, name: &str, class: ApiClass) {
        let Some(&i) = self.by_key.get(&(object.to_string(), file_offset)) else {
            return;
        };
        let e = &mut self.entries[i as usize];
        if !e.0.split('|').any(|n| n == name) {
            e.0 = format!("{}|{name}", e.0);
        }
        e.1 = e.1.max(class);
    }

    /// Whether any library has been searched yet.
    pub fn looked_up(&self) -> bool {
        !self.lookups.is_empty()
    }

    /// Takes in lookups made elsewhere ([`prefetch`]); its own are kept.
    pub fn absorb(&mut self, lookups: Lookups) {
        for (k, v) in lookups {
            self.lookups.entry(k).or_insert(v);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What resolution found: the probes, and what was looked for in vain.
#[derive(Debug, Default)]
pub struct Resolution {
    pub apis: Vec<ResolvedApi>,
    /// Libraries of a set that were searched (path in the target).
    pub searched: Vec<String>,
    /// User APIs that did not resolve, with why.
    pub misses: Vec<String>,
    /// Set libraries left for a later arm ([`SetLookups::CachedOnly`]).
    pub deferred: Vec<String>,
}

fn basename(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// One mapping per file (the first, usually the read-only header page).
fn unique_files(maps: &[Mapping]) -> Vec<&Mapping> {
    let mut seen: Vec<(&str, u64)> = Vec::new();
    let mut out = Vec::new();
    for m in maps {
        if !seen.contains(&(m.path.as_str(), m.inode)) {
            seen.push((m.path.as_str(), m.inode));
            out.push(m);
        }
    }
    out
}

/// Resolves the API sets and user APIs against the target's current maps.
/// Indices come from (and extend) `table`.
pub fn resolve(
    target: &Target,
    sets: &[ApiSet],
    user: &[ApiSpec],
    table: &mut ApiTable,
    set_lookups: SetLookups,
) -> Result<Resolution> {
    let maps = target.maps()?;
    let files = unique_files(&maps);
    let exe = std::fs::read_link(format!("/proc/{}/exe", target.host_pid))
        .map(|p| {
            p.to_string_lossy()
                .trim_end_matches(" (deleted)")
                .to_string()
        })
        .unwrap_or_default();
    let mut res = Resolution::default();
    // Opened on first use only: a file whose lookups are all cached is
    // not read again.
    let mut images: HashMap<String, Option<ElfImage>> = HashMap::new();
    // `exported`: an API set's functions are the library's exports, so only
    // its dynamic symbols are searched (a tenth of libtorch_cpu's).
    let mut lookup = |table: &mut ApiTable,
                      m: &Mapping,
                      symbols: &[&str],
                      exported: bool|
     -> Option<Vec<Vec<SymbolHit>>> {
        let key = |s: &str| (m.path.clone(), m.inode, s.to_string(), exported);
        if let Some(all) = symbols
            .iter()
            .map(|s| table.lookups.get(&key(s)).cloned())
            .collect::<Option<Vec<_>>>()
        {
            return Some(all);
        }
        let img = images
            .entry(m.path.clone())
            .or_insert_with(|| match crate::target::mount::open_elf(target, m) {
                Ok(i) => Some(i),
                Err(e) => {
                    log::debug!("api: cannot read {}: {e:#}", m.path);
                    None
                }
            })
            .as_ref()?;
        let all = if exported {
            img.find_exported_functions(symbols)
        } else {
            img.find_functions(symbols)
        };
        for (s, hits) in symbols.iter().zip(&all) {
            if let Some(sink) = &table.sink {
                sink.publish(key(s), hits.clone());
            }
            table.lookups.insert(key(s), hits.clone());
        }
        Some(all)
    };
    // (mapping, label, class, where its symbol was found)
    let mut wanted: Vec<(&Mapping, String, ApiClass, Vec<SymbolHit>)> = Vec::new();
    for set in sets {
        for m in &files {
            let base = basename(&m.path);
            if !set.libs.iter().any(|l| base.starts_with(l)) {
                continue;
            }
            let names: Vec<&str> = set.apis.iter().map(|a| a.name).collect();
            if set_lookups == SetLookups::CachedOnly
                && !names.iter().all(|n| {
                    table
                        .lookups
                        .contains_key(&(m.path.clone(), m.inode, n.to_string(), true))
                })
            {
                res.deferred.push(m.path.clone());
                continue;
            }
            // One pass over the file's symbols for the whole set.
            let Some(found) = lookup(table, m, &names, true) else {
                continue;
            };
            res.searched.push(m.path.clone());
            for (a, hits) in set.apis.iter().zip(found) {
                wanted.push((m, a.name.to_string(), a.class, hits));
            }
        }
    }
    for u in user {
        let objs: Vec<&Mapping> = files
            .iter()
            .copied()
            .filter(|m| match &u.object {
                ObjectRef::Exe => m.path == exe,
                ObjectRef::Path(p) => &m.path == p,
                ObjectRef::Lib(frag) => basename(&m.path).contains(frag.as_str()),
            })
            .collect();
        if objs.is_empty() {
            res.misses.push(format!(
                "{}: the object is not mapped by PID {}",
                u.raw, target.host_pid
            ));
        }
        let mut found = false;
        for m in objs {
            let Some(hits) =
                lookup(table, m, &[u.symbol.as_str()], false).and_then(|mut v| v.pop())
            else {
                continue;
            };
            if !hits.is_empty() {
                found = true;
                wanted.push((m, u.label.clone(), u.class, hits));
            }
        }
        if !found {
            res.misses.push(format!(
                "{}: no function `{}` in the matching objects",
                u.raw, u.symbol
            ));
        }
    }
    let mut seen: Vec<(String, u64)> = Vec::new();
    for (m, label, class, hits) in wanted {
        for hit in hits {
            // Aliases (two names, one address: identical functions folded
            // by the linker) are probed once, under both names: the kernel
            // cannot tell which name the caller used.
            if seen.contains(&(m.path.clone(), hit.file_offset)) {
                table.add_alias(&m.path, hit.file_offset, &label, class);
                continue;
            }
            seen.push((m.path.clone(), hit.file_offset));
            let index = table.index_for(&m.path, hit.file_offset, &label, class);
            res.apis.push(ResolvedApi {
                index,
                name: label.clone(),
                class,
                object: m.path.clone(),
                attach_path: host_path_for(target, m),
                symbol: hit.demangled,
                file_offset: hit.file_offset,
            });
        }
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_classify_synchronize_calls_as_waits() {
        for n in [
            "aclrtSynchronizeStream",
            "aclrtSynchronizeStreamWithTimeout",
            "aclrtSynchronizeDevice",
            "aclrtSynchronizeEvent",
        ] {
            assert_eq!(builtin_class(n), Some(ApiClass::DeviceWait), "{n}");
        }
        for n in [
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaEventSynchronize",
        ] {
            assert_eq!(builtin_class(n), Some(ApiClass::DeviceWait), "{n}");
        }
        for n in [
            "aclrtLaunchKernel",
            "aclrtMemcpy",
            "cudaMemcpy",
            "cuLaunchKernel",
            "aclmdlExecute",
            "HcclAllReduce",
            "ncclAllReduce",
        ] {
            assert_eq!(builtin_class(n), Some(ApiClass::Call), "{n}");
        }
        // Collectives on NPU/GPU enqueue and return: only c10d's host
        // waits are collective wait.
        for n in [
            "c10d::Reducer::finalize_backward",
            "c10d::Work::wait",
            "c10d::ProcessGroupGloo::SendWork::wait",
            "c10d::ProcessGroupGloo::RecvWork::wait",
        ] {
            assert_eq!(builtin_class(n), Some(ApiClass::CollectiveWait), "{n}");
        }
        assert_eq!(builtin_class("aclrtSynchronizeStreamX"), None);
        assert_eq!(CANN.apis.len(), 12);
        assert_eq!(CUDA_RUNTIME.apis.len() + CUDA_DRIVER.apis.len(), 9);
    }

    #[test]
    fn library_prefixes_do_not_confuse_cuda_and_cudart() {
        let m = |set: &ApiSet, f: &str| set.libs.iter().any(|l| f.starts_with(l));
        assert!(m(&CUDA_DRIVER, "libcuda.so.1"));
        assert!(!m(&CUDA_DRIVER, "libcudart.so.12"));
        assert!(m(&CUDA_RUNTIME, "libcudart-d0da41ae.so.11.0"));
        assert!(m(&CANN, "libascendcl.so"));
        assert!(m(&CANN, "libacl_rt.so"));
        assert!(!m(&CANN, "libascendcl_impl.so"));
        assert!(m(&HCCL, "libhccl.so") && !m(&HCCL, "libhccl_alg.so"));
        assert!(m(&NCCL, "libnccl.so.2") && !m(&NCCL, "libnccl-net.so"));
        // Debian's versioned name and the wheel's plain one.
        assert!(m(&C10D, "libtorch_cpu.so.1.13") && m(&C10D, "libtorch_cpu.so"));
        assert!(!m(&C10D, "libtorch_python.so"));
    }

    #[test]
    fn prefetch_hands_over_what_it_has_and_says_when_it_is_done() {
        let p = std::sync::Arc::new(Prefetch::default());
        let key = |s: &str| ("/lib/libtorch_cpu.so".to_string(), 7, s.to_string(), true);
        p.publish(key("c10d::Work::wait"), Vec::new());
        // Still running: what is there so far, after the bound.
        let (got, done) = p.take(std::time::Duration::from_millis(1));
        assert_eq!((got.len(), done), (1, false));
        // The thread finishing wakes a waiting arm before its bound.
        let q = p.clone();
        let finisher = std::thread::spawn(move || {
            q.publish(key("c10d::Reducer::finalize_backward"), Vec::new());
            q.finish();
        });
        let (got, done) = p.take(std::time::Duration::from_secs(600));
        finisher.join().unwrap();
        assert!(done);
        // Handed over once: an entry taken before is not given again.
        assert_eq!(
            got.keys().cloned().collect::<Vec<_>>(),
            vec![key("c10d::Reducer::finalize_backward")]
        );
    }

    #[test]
    fn aliases_share_one_entry() {
        let mut t = ApiTable::default();
        let i = t.index_for("/lib/a.so", 0x10, "f", ApiClass::Call);
        t.add_alias("/lib/a.so", 0x10, "g", ApiClass::DeviceWait);
        t.add_alias("/lib/a.so", 0x10, "g", ApiClass::Call);
        assert_eq!(t.name(i), Some(("f|g", ApiClass::DeviceWait)));
        assert_eq!(t.index_for("/lib/a.so", 0x10, "f", ApiClass::Call), i);
        assert_eq!(t.index_for("/lib/b.so", 0x10, "f", ApiClass::Call), i + 1);
    }

    #[test]
    fn user_api_grammar() {
        let a = parse_api_spec("exe:my_sync,wait").unwrap();
        assert_eq!(
            (a.object.clone(), a.symbol.as_str(), a.class),
            (ObjectRef::Exe, "my_sync", ApiClass::DeviceWait)
        );
        let a = parse_api_spec("libfoo:my_barrier,name=barrier,collective").unwrap();
        assert_eq!(
            (a.symbol.as_str(), a.label.as_str(), a.class),
            ("my_barrier", "barrier", ApiClass::CollectiveWait)
        );
        let a = parse_api_spec("libhccl:HcclAllReduce,name=allreduce").unwrap();
        assert_eq!(a.object, ObjectRef::Lib("libhccl".into()));
        assert_eq!(
            (a.symbol.as_str(), a.label.as_str(), a.class),
            ("HcclAllReduce", "allreduce", ApiClass::Call)
        );
        let a = parse_api_spec("/opt/x/libfoo.so:ns::f(int)").unwrap();
        assert_eq!(a.object, ObjectRef::Path("/opt/x/libfoo.so".into()));
        assert_eq!(a.symbol, "ns::f(int)");
        assert!(parse_api_spec("exe:f+0x10").is_err());
        assert!(parse_api_spec("auto").is_err());
        assert!(parse_api_spec("usdt:libfoo:p:n").is_err());
        assert!(parse_api_spec("exe:f,role=aux").is_err());
        assert!(parse_api_spec("nocolon").is_err());
    }
}
