//! The runtime API tables the `api` collector probes, user-added APIs
//! (`--api OBJECT:SYMBOL[,wait]`), and their resolution through the
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
    probes::{
        resolve::host_path_for,
        spec::{self, Location, MarkerArg, ObjectRef},
    },
    symbols::ElfImage,
    target::{Mapping, Target},
};

/// One function of an API set.
#[derive(Clone, Copy, Debug)]
pub struct ApiDef {
    pub name: &'static str,
    /// The host waits for the device in this call (synchronize calls).
    pub device_wait: bool,
}

const fn api(name: &'static str) -> ApiDef {
    ApiDef {
        name,
        device_wait: false,
    }
}
const fn wait(name: &'static str) -> ApiDef {
    ApiDef {
        name,
        device_wait: true,
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

pub const BUILTIN_SETS: &[ApiSet] = &[CANN, CUDA_RUNTIME, CUDA_DRIVER, HCCL, NCCL];

/// Is this a synchronize-type API of a built-in set?
pub fn is_device_wait(name: &str) -> bool {
    BUILTIN_SETS
        .iter()
        .flat_map(|s| s.apis)
        .any(|a| a.name == name && a.device_wait)
}

/// A user-added API: `--api OBJECT:SYMBOL[,name=LABEL][,wait]`, with the
/// object grammar of `--marker` (`exe`, an absolute path in the target, or a
/// library-name fragment). `,wait` classifies its time as device wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiSpec {
    pub raw: String,
    pub object: ObjectRef,
    pub symbol: String,
    /// Name in outputs (default: the symbol).
    pub label: String,
    pub device_wait: bool,
}

pub fn parse_api_spec(raw: &str) -> Result<ApiSpec> {
    let s = raw.trim();
    let (s, device_wait) = match s.strip_suffix(",wait") {
        Some(rest) => (rest, true),
        None => (s, false),
    };
    let hint = "hint: --api OBJECT:SYMBOL[,name=LABEL][,wait], OBJECT = exe | /path/in/target | library-name fragment";
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
        device_wait,
    })
}

/// One probed function in one object.
#[derive(Clone, Debug, Serialize)]
pub struct ResolvedApi {
    /// The attach cookie: index into the collector's API table.
    pub index: u32,
    pub name: String,
    pub device_wait: bool,
    /// Path as the target sees it.
    pub object: String,
    #[serde(skip)]
    pub attach_path: PathBuf,
    pub symbol: String,
    pub file_offset: u64,
}

/// The collector's API table. Indices are stable for the collector's life:
/// an event read after re-arming still names the right API.
#[derive(Default, Debug)]
pub struct ApiTable {
    entries: Vec<(String, bool)>,
    by_key: HashMap<(String, u64), u32>,
}

impl ApiTable {
    pub fn name(&self, index: u32) -> Option<(&str, bool)> {
        self.entries
            .get(index as usize)
            .map(|(n, w)| (n.as_str(), *w))
    }

    fn index_for(&mut self, object: &str, file_offset: u64, name: &str, wait: bool) -> u32 {
        if let Some(&i) = self.by_key.get(&(object.to_string(), file_offset)) {
            return i;
        }
        let i = self.entries.len() as u32;
        self.entries.push((name.to_string(), wait));
        self.by_key.insert((object.to_string(), file_offset), i);
        i
    }

    fn add_alias(&mut self, object: &str, file_offset: u64, name: &str, wait: bool) {
        let Some(&i) = self.by_key.get(&(object.to_string(), file_offset)) else {
            return;
        };
        let e = &mut self.entries[i as usize];
        if !e.0.split('|').any(|n| n == name) {
            e.0 = format!("{}|{name}", e.0);
        }
        e.1 |= wait;
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
    let mut images: HashMap<String, Option<ElfImage>> = HashMap::new();
    let open = |images: &mut HashMap<String, Option<ElfImage>>, m: &Mapping| -> bool {
        images
            .entry(m.path.clone())
            .or_insert_with(|| match crate::target::mount::open_elf(target, m) {
                Ok(i) => Some(i),
                Err(e) => {
                    log::debug!("api: cannot read {}: {e:#}", m.path);
                    None
                }
            })
            .is_some()
    };
    let mut wanted: Vec<(&Mapping, String, String, bool)> = Vec::new();
    for set in sets {
        for m in &files {
            let base = basename(&m.path);
            if !set.libs.iter().any(|l| base.starts_with(l)) || !open(&mut images, m) {
                continue;
            }
            res.searched.push(m.path.clone());
            for a in set.apis {
                wanted.push((m, a.name.to_string(), a.name.to_string(), a.device_wait));
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
            if !open(&mut images, m) {
                continue;
            }
            let img = images[&m.path].as_ref().expect("opened");
            if !img.find_function(&u.symbol).is_empty() {
                found = true;
                wanted.push((m, u.symbol.clone(), u.label.clone(), u.device_wait));
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
    for (m, symbol, label, wait) in wanted {
        let Some(Some(img)) = images.get(&m.path) else {
            continue;
        };
        for hit in img.find_function(&symbol) {
            // Aliases (two names, one address: identical functions folded
            // by the linker) are probed once, under both names: the kernel
            // cannot tell which name the caller used.
            if seen.contains(&(m.path.clone(), hit.file_offset)) {
                table.add_alias(&m.path, hit.file_offset, &label, wait);
                continue;
            }
            seen.push((m.path.clone(), hit.file_offset));
            let index = table.index_for(&m.path, hit.file_offset, &label, wait);
            res.apis.push(ResolvedApi {
                index,
                name: label.clone(),
                device_wait: wait,
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
            assert!(is_device_wait(n), "{n}");
        }
        for n in [
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaEventSynchronize",
        ] {
            assert!(is_device_wait(n), "{n}");
        }
        for n in [
            "aclrtLaunchKernel",
            "aclrtMemcpy",
            "cudaMemcpy",
            "cuLaunchKernel",
            "aclmdlExecute",
        ] {
            assert!(!is_device_wait(n), "{n}");
        }
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
    }

    #[test]
    fn aliases_share_one_entry() {
        let mut t = ApiTable::default();
        let i = t.index_for("/lib/a.so", 0x10, "f", false);
        t.add_alias("/lib/a.so", 0x10, "g", true);
        t.add_alias("/lib/a.so", 0x10, "g", true);
        assert_eq!(t.name(i), Some(("f|g", true)));
        assert_eq!(t.index_for("/lib/a.so", 0x10, "f", false), i);
        assert_eq!(t.index_for("/lib/b.so", 0x10, "f", false), i + 1);
    }

    #[test]
    fn user_api_grammar() {
        let a = parse_api_spec("exe:my_sync,wait").unwrap();
        assert_eq!(
            (a.object.clone(), a.symbol.as_str(), a.device_wait),
            (ObjectRef::Exe, "my_sync", true)
        );
        let a = parse_api_spec("libhccl:HcclAllReduce,name=allreduce").unwrap();
        assert_eq!(a.object, ObjectRef::Lib("libhccl".into()));
        assert_eq!(
            (a.symbol.as_str(), a.label.as_str(), a.device_wait),
            ("HcclAllReduce", "allreduce", false)
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
