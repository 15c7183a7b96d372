//! `dynprof report` on windows written by the real writer.
use super::{compare::*, render::*, *};
use crate::output::model::*;
use crate::output::tables::API_SUMMARY_FILE;
use crate::output::tests_support::tempdir;
use crate::output::write_window_files;
use crate::types::StepIndex;

/// 4 steps of 10 ms from t=1 s. Per step: two launches (one from a
/// task-queue thread), one sync of `wait_ns`, and CPU samples split 3:1
/// between `hot` and `other` frames.
fn window(wait_ns: u64, hot: &str) -> WindowData {
    let t0 = 1_000_000_000u64;
    let step_ns = 10_000_000u64;
    let mut d = WindowData {
        process_name: "trainer".into(),
        host_pid: 777,
        thread_names: vec![(777, "trainer".into()), (778, "acl_taskq".into())],
        ..Default::default()
    };
    for k in 0..4u64 {
        let s = t0 + k * step_ns;
        d.steps.push(StepSpan {
            step: StepIndex(k + 5),
            start_ts_ns: s,
            end_ts_ns: s + step_ns,
            tid: 777,
            aux: vec![("backward".into(), 1)],
        });
        d.api_calls.push(ApiCall {
            tid: 777,
            api: "aclrtLaunchKernel".into(),
            start_ts_ns: s + 100_000,
            dur_ns: 20_000,
            ret: 0,
            class: crate::output::model::ApiClass::Call,
        });
        d.api_calls.push(ApiCall {
            tid: 778,
            api: "aclrtLaunchKernel".into(),
            start_ts_ns: s + 200_000,
            dur_ns: 20_000,
            ret: 0,
            class: crate::output::model::ApiClass::Call,
        });
        let sync_start = s + step_ns - wait_ns - 1_000;
        d.api_calls.push(ApiCall {
            tid: 777,
            api: "aclrtSynchronizeStream".into(),
            start_ts_ns: sync_start,
            dur_ns: wait_ns,
            ret: 0,
            class: crate::output::model::ApiClass::DeviceWait,
        });
        d.offcpu.push(OffCpuSpan {
            runnable: false,
            tid: 777,
            ts_ns: sync_start + 500,
            dur_ns: wait_ns - 1_000,
            stack: vec![
                "main".into(),
                "aclrtSynchronizeStream".into(),
                "schedule_[k]".into(),
            ]
            .into(),
        });
        for j in 0..4u64 {
            let leaf = if j < 3 { hot } else { "other" };
            d.samples.push(CpuSample {
                tid: 777,
                ts_ns: s + 300_000 + j * 10_000,
                stack: vec!["main".into(), "train_step".into(), leaf.into()].into(),
            });
        }
    }
    d
}

fn write(d: &WindowData, meta: Option<&str>) -> PathBuf {
    let dir = tempdir("report");
    let files = write_window_files(&dir, d, &Collectors::ALL).unwrap();
    for f in [
        "steps.csv",
        "api_summary.csv",
        "cpu.folded",
        "flamegraph.svg",
        "offcpu.folded",
        "offcpu.svg",
        "trace.json",
        "summary.json",
    ] {
        assert!(files.contains(&dir.join(f)), "{f} not written: {files:?}");
        assert!(dir.join(f).exists());
    }
    assert!(
        !std::fs::read_dir(&dir).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp"))
    );
    if let Some(m) = meta {
        std::fs::write(dir.join(META_FILE), m).unwrap();
    }
    dir
}

#[test]
fn host_bound_window() {
    // 2.8 ms of 10 ms waiting: 72% outside device waits.
    let dir = write(
        &window(2_800_000, "hot_cpu_work"),
        Some(r#"{"complete":true,"target":{"host_pid":777}}"#),
    );
    let a = analyze(&dir).unwrap();
    assert_eq!(a.complete, Some(true));
    assert_eq!(a.step_time.count, 4);
    assert_eq!(a.step_time.mean_ns, 10_000_000);
    assert_eq!(a.device_wait_ns, 4 * 2_800_000);
    assert_eq!(a.host_busy_ns, 4 * 7_200_000);
    assert_eq!(a.api_calls, 12);
    assert_eq!(
        a.steps[0],
        StepLine {
            step: 5,
            duration_ns: 10_000_000,
            device_wait_ns: 2_800_000,
            host_busy_ns: 7_200_000,
            api_calls: 3
        }
    );
    assert_eq!(a.top_apis[0].api, "aclrtSynchronizeStream");
    assert_eq!(a.top_apis[0].total_ns, 4 * 2_800_000);
    assert_eq!(a.top_apis[1].calls, 8);
    assert_eq!(a.cpu_samples, 16);
    assert_eq!(
        a.top_frames_self[0],
        FrameCount {
            frame: "hot_cpu_work".into(),
            self_samples: 12,
            inclusive_samples: 12
        }
    );
    assert_eq!(a.top_frames_inclusive[0].inclusive_samples, 16);
    assert_eq!(a.verdict.bound, Bound::HostBound);
    assert_eq!(
        a.verdict.text,
        "host-bound: 72% of step time outside device waits; top frame: hot_cpu_work"
    );
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    let text = render_one(&a);
    println!("{text}");
    assert!(text.contains("verdict: host-bound: 72%"), "{text}");
    assert!(text.contains("aclrtLaunchKernel"));
    let j = to_json(std::slice::from_ref(&a));
    assert_eq!(j["verdict"]["bound"], "host-bound");
    assert_eq!(j["step_time"]["p99_ns"], 10_000_000);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn device_bound_window_and_comparison() {
    let before = write(&window(6_400_000, "wait_loop"), None);
    let a = analyze(&before).unwrap();
    assert_eq!(a.complete, None);
    assert!(a.warnings[0].contains("no meta.json"));
    assert_eq!(a.device_wait_ns, 4 * 6_400_000);
    assert_eq!(a.verdict.bound, Bound::DeviceBound);
    assert_eq!(
        a.verdict.text,
        "device-bound: 64% of step time in device waits (aclrtSynchronizeStream); top frame: wait_loop"
    );

    let after = write(
        &window(2_800_000, "hot_cpu_work"),
        Some(r#"{"complete":false,"incomplete_reason":"target exited"}"#),
    );
    let b = analyze(&after).unwrap();
    assert!(
        b.warnings.iter().any(|w| w == "INCOMPLETE: target exited"),
        "{:?}",
        b.warnings
    );
    let text = render_compare(&[a.clone(), b.clone()]);
    println!("{text}");
    assert!(text.contains("INCOMPLETE (target exited)"), "{text}");
    assert!(text.contains("[2]/[1]"), "{text}");
    // Device wait per step 6.4 ms -> 2.8 ms.
    assert!(text.contains("0.44x"), "{text}");
    let j = to_json(&[a, b]);
    let row = j["comparison"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["metric"] == "device wait / step")
        .unwrap();
    assert_eq!(row["values"][0], 6_400_000.0);
    assert_eq!(row["ratios_to_first"][1], 0.4375);
    std::fs::remove_dir_all(&before).unwrap();
    std::fs::remove_dir_all(&after).unwrap();
}

#[test]
fn not_a_prof_dir_and_missing_api() {
    let dir = tempdir("report-empty");
    let e = analyze(&dir).unwrap_err().to_string();
    assert!(e.contains("not a dynprof PROF directory"), "{e}");
    assert!(analyze(&dir.join("nope")).is_err());

    let only_cpu = Collectors {
        api: false,
        cpu: true,
        offcpu: false,
    };
    write_window_files(&dir, &window(1_000_000, "f"), &only_cpu).unwrap();
    assert!(!dir.join(API_SUMMARY_FILE).exists());
    assert!(!dir.join("offcpu.folded").exists());
    let a = analyze(&dir).unwrap();
    assert_eq!(a.verdict.bound, Bound::Unknown);
    assert!(a.verdict.text.contains("api collector did not run"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn many_steps_are_summarized() {
    let steps: Vec<StepLine> = (0..50)
        .map(|i| StepLine {
            step: i,
            duration_ns: 1_000 + i,
            device_wait_ns: i * 10,
            host_busy_ns: 1_000 - 9 * i,
            api_calls: 1,
        })
        .collect();
    let t = step_table(&steps);
    assert!(t.contains("50 steps; device-wait share min 0.0%"), "{t}");
    assert!(t.contains("slowest 5"));
    assert!(t.contains(" 49 "));
}
