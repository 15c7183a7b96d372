//! `--marker auto`: pick step markers from what the target has mapped.
use anyhow::{Result, bail};

use super::spec::{self, MarkerArg, MarkerSpec};
use crate::target::Mapping;

/// PyTorch's optimizer wrapper names its record_function `Optimizer.step#<Class>.step`.
/// On torch 1.13 the name reaches `ConstantString::create(std::string)`;
/// `record_function_enter_new` is never hit there. Torch 2.x passes it to
/// both, so `create` works on both and is tried first; 2.x builds without
/// it fall back to `enter_new`.
///
/// Both return a class by value (`c10::intrusive_ptr`), so the caller
/// passes a hidden result pointer, and where it goes is the ABI's choice:
/// x86-64 (SysV) passes it as argument 0 (rdi), which moves the name to
/// argument 1 (rsi); arm64 (AAPCS64) passes it in x8, outside the argument
/// registers, and the name stays argument 0 (x0). With x86-64's index on
/// arm64 the filter read the wrong register and no step ever matched.
#[cfg(not(target_arch = "aarch64"))]
pub const TORCH_STEP: &[&str] = &[
    "libtorch_cpu:c10::ivalue::ConstantString::create(std::string),arg=1:str,prefix=Optimizer.step#,name=Optimizer.step",
    "libtorch_cpu:torch::autograd::profiler::record_function_enter_new,arg=1:str,prefix=Optimizer.step#,name=Optimizer.step",
];
/// [`TORCH_STEP`] for arm64: the hidden result pointer is in x8.
#[cfg(target_arch = "aarch64")]
pub const TORCH_STEP: &[&str] = &[
    "libtorch_cpu:c10::ivalue::ConstantString::create(std::string),arg=0:str,prefix=Optimizer.step#,name=Optimizer.step",
    "libtorch_cpu:torch::autograd::profiler::record_function_enter_new,arg=0:str,prefix=Optimizer.step#,name=Optimizer.step",
];
/// One hit per backward pass.
pub const TORCH_AUX: &str = "libtorch_cpu:torch::autograd::Engine::execute,role=aux,name=backward";

/// Which runtimes a process has mapped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Runtimes {
    pub torch: bool,
    pub torch_npu: bool,
    pub cann: bool,
    pub cuda: bool,
    pub python: bool,
}

pub fn detect(maps: &[Mapping]) -> Runtimes {
    let mut r = Runtimes::default();
    for m in maps {
        let base = m.path.rsplit('/').next().unwrap_or("");
        r.torch |= base.starts_with("libtorch_cpu");
        r.torch_npu |= base.starts_with("libtorch_npu");
        r.cann |= base.starts_with("libascendcl") || base.starts_with("libacl_rt");
        r.cuda |= base.starts_with("libcudart") || base.starts_with("libcuda.so");
        r.python |= base.starts_with("python3") || base.starts_with("libpython3");
    }
    r
}

impl Runtimes {
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.torch {
            v.push("torch");
        }
        if self.torch_npu {
            v.push("torch_npu");
        }
        if self.cann {
            v.push("cann");
        }
        if self.cuda {
            v.push("cuda");
        }
        if self.python {
            v.push("python");
        }
        v
    }
}

/// Candidate step-marker groups, in order of preference; resolution takes
/// the first step marker that resolves, plus every aux marker that does.
pub fn auto_markers(maps: &[Mapping]) -> Result<Vec<Vec<MarkerSpec>>> {
    let rt = detect(maps);
    if rt.torch {
        let aux = parse(TORCH_AUX);
        return Ok(TORCH_STEP
            .iter()
            .map(|s| vec![parse(s), aux.clone()])
            .collect());
    }
    let mut looked = vec!["libtorch_cpu (PyTorch optimizer step)".to_string()];
    if rt.python {
        looked.push(
            "a Python interpreter was found: name the step function with `--marker python:FUNC`"
                .into(),
        );
    }
    if rt.cann || rt.cuda {
        looked.push(
            "a device runtime was found but no framework: name the step symbol, e.g. `--marker exe:train_step`".into(),
        );
    }
    bail!(
        "--marker auto found no known framework in the target's mappings; looked for: {} \
         (hint: name the step function yourself: `--marker exe:SYMBOL` or `--marker LIBRARY:SYMBOL` \
         for native code, `--marker python:FUNC` for Python)",
        looked.join("; ")
    )
}

fn parse(s: &str) -> MarkerSpec {
    match spec::parse(s) {
        Ok(MarkerArg::Spec(m)) => m,
        other => unreachable!("preset {s} must parse: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse() {
        for s in TORCH_STEP {
            assert_eq!(parse(s).role, spec::Role::Step);
        }
        assert_eq!(parse(TORCH_AUX).role, spec::Role::Aux);
    }
}
