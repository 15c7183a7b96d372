//! profiler_config.json: the torch_npu template, and what a saved file asks for.
use super::*;
use crate::types::Builtin;

/// The torch_npu default `profiler_config.json`, key for key.
pub fn template() -> Value {
    json!({
        "activities": ["CPU", "NPU"],
        "prof_dir": "./",
        "analyse": false,
        "record_shapes": false,
        "profile_memory": false,
        "with_stack": false,
        "with_flops": false,
        "with_modules": false,
        "active": 1,
        "warmup": 0,
        "start_step": 0,
        "is_rank": false,
        "rank_list": [],
        "experimental_config": {
            "profiler_level": "Level0",
            "aic_metrics": "AiCoreNone",
            "l2_cache": false,
            "op_attr": false,
            "gc_detect_threshold": null,
            "data_simplification": true,
            "record_op_args": false,
            "export_type": ["text"],
            "mstx": false,
            "mstx_domain_include": [],
            "mstx_domain_exclude": [],
            "host_sys": [],
            "sys_io": false,
            "sys_interconnection": false
        }
    })
}

/// Top-level fields of the torch_npu schema (the template plus the two
/// optional ones).
pub(super) const KNOWN: &[&str] = &[
    "activities",
    "prof_dir",
    "analyse",
    "record_shapes",
    "profile_memory",
    "with_stack",
    "with_flops",
    "with_modules",
    "active",
    "warmup",
    "start_step",
    "is_rank",
    "rank_list",
    "async_mode",
    "experimental_config",
    "metadata",
];

/// torch_npu fields dynprof accepts but cannot act on (a non-default value
/// gets one warning).
pub(super) const NO_EFFECT: &[&str] = &[
    "analyse",
    "record_shapes",
    "profile_memory",
    "with_flops",
    "with_modules",
    "async_mode",
];

/// A validated config: what dynprof will do with it.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub plan: Plan,
    pub collect: Vec<Builtin>,
    pub prof_dir: String,
    pub is_rank: bool,
    pub rank_list: Vec<i64>,
    pub metadata: Option<Value>,
    pub raw: Value,
    /// Fields present that dynprof cannot act on, or does not know.
    pub no_effect: Vec<String>,
    pub unknown: Vec<String>,
}

/// Validates a `profiler_config.json` text. Missing fields take the
/// torch_npu defaults.
pub fn parse(text: &str) -> Result<Parsed> {
    let raw: Value =
        serde_json::from_str(text).map_err(|e| anyhow::anyhow!("invalid JSON: {e}"))?;
    let Some(obj) = raw.as_object() else {
        bail!("invalid config: the top level must be a JSON object")
    };
    let defaults = template();
    let get = |k: &str| {
        obj.get(k)
            .or_else(|| defaults.get(k))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let boolean = |k: &str| -> Result<bool> {
        match get(k) {
            Value::Bool(b) => Ok(b),
            Value::Null => Ok(false),
            v => bail!("invalid field `{k}`: expected true or false, got {v}"),
        }
    };
    let int = |k: &str, min: i64| -> Result<i64> {
        match get(k).as_i64() {
            Some(v) if v >= min => Ok(v),
            Some(v) => bail!("invalid field `{k}`: must be >= {min}, got {v}"),
            None => bail!("invalid field `{k}`: expected an integer, got {}", get(k)),
        }
    };
    let start_step = int("start_step", -1)?;
    let warmup = int("warmup", 0)? as u64;
    let active = int("active", 1)? as u64;
    let is_rank = boolean("is_rank")?;
    let rank_list = match get("rank_list") {
        Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_i64().filter(|r| *r >= 0).ok_or_else(|| {
                    anyhow::anyhow!("invalid field `rank_list`: {v} is not a rank number")
                })
            })
            .collect::<Result<Vec<_>>>()?,
        v => bail!("invalid field `rank_list`: expected a list of rank numbers, got {v}"),
    };
    let activities: Vec<String> = match get("activities") {
        Value::Array(a) => a
            .iter()
            .map(|v| match v.as_str() {
                Some(s @ ("CPU" | "NPU")) => Ok(s.to_string()),
                _ => bail!("invalid field `activities`: {v} is not \"CPU\" or \"NPU\""),
            })
            .collect::<Result<Vec<_>>>()?,
        v => {
            bail!("invalid field `activities`: expected a list such as [\"CPU\", \"NPU\"], got {v}")
        }
    };
    let prof_dir = match get("prof_dir") {
        Value::String(s) if !s.is_empty() => s,
        v => bail!("invalid field `prof_dir`: expected a non-empty path string, got {v}"),
    };
    let with_stack = boolean("with_stack")?;
    for k in NO_EFFECT {
        boolean(k)?;
    }
    if !matches!(get("experimental_config"), Value::Object(_) | Value::Null) {
        bail!("invalid field `experimental_config`: expected an object");
    }
    let metadata = match obj.get("metadata") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(v) => bail!("invalid field `metadata`: expected an object, got {v}"),
    };
    // activities / with_stack → collectors.
    let mut collect = Vec::new();
    if activities.iter().any(|a| a == "NPU") {
        collect.push(Builtin::Api);
    }
    if activities.iter().any(|a| a == "CPU") {
        collect.push(Builtin::Cpu);
    }
    if with_stack {
        collect.push(Builtin::Offcpu);
    }
    let no_effect = NO_EFFECT
        .iter()
        .filter(|k| {
            obj.get(**k)
                .is_some_and(|v| v != &defaults.get(**k).cloned().unwrap_or(Value::Bool(false)))
        })
        .map(|k| k.to_string())
        .collect();
    let unknown = obj
        .keys()
        .filter(|k| !KNOWN.contains(&k.as_str()))
        .cloned()
        .collect();
    Ok(Parsed {
        plan: Plan {
            start_step,
            warmup,
            active,
            repeat: 0,
            gap: 0,
        },
        collect,
        prof_dir,
        is_rank,
        rank_list,
        metadata,
        raw,
        no_effect,
        unknown,
    })
}

/// Keys of a JSON object, recursively (`a.b` for nested objects).
pub fn key_paths(v: &Value) -> BTreeSet<String> {
    fn walk(prefix: &str, v: &Map<String, Value>, out: &mut BTreeSet<String>) {
        for (k, val) in v {
            let p = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.insert(p.clone());
            if let Value::Object(o) = val {
                walk(&p, o, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    if let Value::Object(o) = v {
        walk("", o, &mut out);
    }
    out
}
