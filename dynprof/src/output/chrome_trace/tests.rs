use super::*;
use crate::output::model::*;
use crate::types::StepIndex;

pub(crate) fn sample_data() -> WindowData {
    let steps = (0..3)
        .map(|k| StepSpan {
            step: StepIndex(10 + k),
            start_ts_ns: 1_000_000 + k * 1_000_000,
            end_ts_ns: 2_000_000 + k * 1_000_000,
            tid: 100,
            aux: vec![("backward".into(), 1)],
        })
        .collect();
    WindowData {
        steps,
        api_calls: vec![
            ApiCall {
                tid: 100,
                api: "aclrtLaunchKernel".into(),
                start_ts_ns: 1_000_100,
                dur_ns: 5_000,
                ret: 0,
                class: crate::output::model::ApiClass::Call,
            },
            ApiCall {
                tid: 101,
                api: "aclrtLaunchKernel".into(),
                start_ts_ns: 1_000_200,
                dur_ns: 5_000,
                ret: 0,
                class: crate::output::model::ApiClass::Call,
            },
            ApiCall {
                tid: 100,
                api: "aclrtSynchronizeStream".into(),
                start_ts_ns: 1_500_000,
                dur_ns: 400_000,
                ret: 0,
                class: crate::output::model::ApiClass::DeviceWait,
            },
        ],
        samples: vec![CpuSample {
            tid: 100,
            ts_ns: 1_200_000,
            stack: vec!["main".into(), "hot_cpu_work".into()].into(),
        }],
        offcpu: vec![
            OffCpuSpan {
                runnable: false,
                tid: 100,
                ts_ns: 1_500_100,
                dur_ns: 399_800,
                stack: vec!["main".into(), "aclrtSynchronizeStream".into()].into(),
            },
            // Ends 50 ns after the sync call returned: must be trimmed.
            OffCpuSpan {
                runnable: false,
                tid: 100,
                ts_ns: 1_899_950,
                dur_ns: 100,
                stack: Stack::from([]),
            },
        ],
        thread_names: vec![(100, "python".into())],
        process_name: "trainer".into(),
        host_pid: 4242,
        drops: Drops::default(),
        budget: WindowBudget::default(),
        modules: Vec::new(),
        api_libraries_pending: Vec::new(),
        apis_traced: Vec::new(),
    }
}

#[test]
fn trace_is_valid_and_complete() {
    let v = build_trace(&sample_data());
    let st = validate_trace(&v).unwrap();
    assert_eq!(st.steps, 3);
    assert_eq!(st.by_cat["api"], 2);
    assert_eq!(st.by_cat["device_wait"], 1);
    assert_eq!(st.by_cat["offcpu"], 2);
    assert_eq!(st.instants, 1);
    // steps track, tid 100, tid 101.
    assert_eq!(st.threads, 3);
    assert_eq!(v["metadata"]["ts_base_ns"], 1_000_000);
    assert_eq!(v["metadata"]["trimmed_slices"], 1);
    let ev = v["traceEvents"].as_array().unwrap();
    let step = ev.iter().find(|e| e["name"] == "step 11").unwrap();
    assert_eq!(step["ts"], 1000.0);
    assert_eq!(step["dur"], 1000.0);
    let sync = ev
        .iter()
        .find(|e| e["name"] == "aclrtSynchronizeStream" && e["ph"] == "X")
        .unwrap();
    assert_eq!(sync["args"]["step"], 10);
    assert_eq!(sync["ts"], 500.0);
    let inst = ev.iter().find(|e| e["ph"] == "i").unwrap();
    assert_eq!(inst["name"], "hot_cpu_work");
    assert!(
        ev.iter()
            .any(|e| e["ph"] == "M" && e["args"]["name"] == "steps" && e["tid"] == 0)
    );
}

#[test]
fn malformed_traces_fail() {
    let good = build_trace(&sample_data());
    // Partial overlap on one thread.
    let mut v = good.clone();
    v["traceEvents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"ph":"X","name":"bad","pid":4242,"tid":100,"ts":450.0,"dur":100.0}));
    assert!(
        validate_trace(&v)
            .unwrap_err()
            .to_string()
            .contains("partially overlaps")
    );
    // Gap between steps.
    let mut d = sample_data();
    d.steps[1].start_ts_ns += 10_000;
    assert!(
        validate_trace(&build_trace(&d))
            .unwrap_err()
            .to_string()
            .contains("contiguous")
    );
    // Missing dur.
    let mut v = good.clone();
    v["traceEvents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"ph":"X","name":"x","pid":1,"tid":1,"ts":1.0}));
    assert!(validate_trace(&v).is_err());
    // Unknown ph, missing name, no events array.
    let mut v = good.clone();
    v["traceEvents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"ph":"Q","name":"x","pid":1,"tid":1,"ts":1.0}));
    assert!(validate_trace(&v).is_err());
    let mut v = good.clone();
    v["traceEvents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"ph":"i","pid":1,"tid":1,"ts":1.0}));
    assert!(validate_trace(&v).is_err());
    assert!(validate_trace(&json!({"events":[]})).is_err());
}

#[test]
fn writes_json_and_no_gzip_when_small() {
    let dir = crate::output::tests_support::tempdir("trace");
    let files = write_trace(&dir, &sample_data()).unwrap();
    assert_eq!(files, vec![dir.join(TRACE_FILE)]);
    let v: Value = serde_json::from_slice(&std::fs::read(&files[0]).unwrap()).unwrap();
    validate_trace(&v).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn writes_gzip_when_large() {
    let mut d = sample_data();
    let stack: Vec<String> = (0..40)
        .map(|i| format!("some::long::frame_name_{i}"))
        .collect();
    d.samples = (0..12_000)
        .map(|i| CpuSample {
            tid: 100,
            ts_ns: 1_000_000 + i * 100,
            stack: stack.clone().into(),
        })
        .collect();
    let dir = crate::output::tests_support::tempdir("trace-gz");
    let files = write_trace(&dir, &d).unwrap();
    assert_eq!(files.len(), 2, "{files:?}");
    let raw = std::fs::read(dir.join(TRACE_FILE)).unwrap();
    assert!(raw.len() > GZIP_THRESHOLD);
    let mut dec =
        flate2::read::GzDecoder::new(std::fs::File::open(dir.join(TRACE_GZ_FILE)).unwrap());
    let mut back = Vec::new();
    std::io::Read::read_to_end(&mut dec, &mut back).unwrap();
    assert_eq!(back, raw);
    std::fs::remove_dir_all(&dir).unwrap();
}
