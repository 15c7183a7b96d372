//! The agent's Prometheus metrics (`GET /metrics`), in the OpenMetrics
//! text format through `prometheus-client`.
//!
//! One series per attached process and metric; the labels are fixed when
//! the process is attached (see [`super::labels`]). A process that exits
//! keeps its series for `--linger` seconds, so the scrape after its last
//! step still sees the final count, and is then removed.
use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// The labels of one attached process. All of them are bounded by the
/// host: one series per process, never per step.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub node: String,
    /// The host PID.
    pub pid: String,
    /// The rank (job mode's rule: RANK and friends, else host-PID order).
    pub rank: String,
    /// The `--job` reference of the job (`dynprof ps --jobs`).
    pub job: String,
    /// The short container id, empty outside a container.
    pub container: String,
    /// The Kubernetes pod UID from the cgroup path.
    pub pod_uid: String,
    /// The pod name, when the container's environment names it.
    pub pod: String,
    /// The pod namespace, when the container's environment names it.
    pub namespace: String,
}

/// What a capture is doing, for `dynprof_captures`.
#[derive(
    Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue, serde::Serialize, serde::Deserialize,
)]
#[allow(non_camel_case_types)]
pub enum CaptureState {
    running,
    written,
    failed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CaptureLabels {
    pub node: String,
    pub state: CaptureState,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
}

/// Bucket upper bounds: 1 ms doubling to 131 s (18 buckets), for steps
/// from a tight inference loop to a long pipeline-parallel iteration.
pub fn step_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 18)
}

fn new_histogram() -> Histogram {
    Histogram::new(step_buckets())
}

/// Every metric the agent exports.
pub struct Metrics {
    pub registry: Registry,
    pub steps: Family<TargetLabels, Counter>,
    pub step_duration: Family<TargetLabels, Histogram, fn() -> Histogram>,
    pub events_lost: Family<TargetLabels, Counter>,
    pub attached: Family<NodeLabels, Gauge>,
    pub captures: Family<CaptureLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let steps = Family::<TargetLabels, Counter>::default();
        let step_duration =
            Family::<TargetLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                new_histogram,
            );
        let events_lost = Family::<TargetLabels, Counter>::default();
        let attached = Family::<NodeLabels, Gauge>::default();
        let captures = Family::<CaptureLabels, Gauge>::default();
        // prometheus-client appends `_total` to counters.
        registry.register(
            "dynprof_steps",
            "Step-marker hits (training steps: one per optimizer.step) since dynprof attached to the process",
            steps.clone(),
        );
        registry.register(
            "dynprof_step_duration_seconds",
            "Time between consecutive step-marker hits of the process",
            step_duration.clone(),
        );
        registry.register(
            "dynprof_events_lost",
            "Events the kernel could not hand to dynprof (ring buffer full)",
            events_lost.clone(),
        );
        registry.register(
            "dynprof_attached_targets",
            "Processes the agent has step markers attached to",
            attached.clone(),
        );
        registry.register(
            "dynprof_captures",
            "Captures requested from this agent, by state",
            captures.clone(),
        );
        Self {
            registry,
            steps,
            step_duration,
            events_lost,
            attached,
            captures,
        }
    }

    /// The series of a newly attached process (present, at zero, from the
    /// attach on: a scrape then tells "attached, no step yet" from "not
    /// attached").
    pub fn target(&self, l: &TargetLabels) -> TargetSeries {
        TargetSeries {
            steps: self.steps.get_or_create(l).clone(),
            duration: self.step_duration.get_or_create(l).clone(),
            lost: self.events_lost.get_or_create(l).clone(),
        }
    }

    /// Forgets a process's series (after its linger time).
    pub fn remove(&self, l: &TargetLabels) {
        self.steps.remove(l);
        self.step_duration.remove(l);
        self.events_lost.remove(l);
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

/// Handles on one process's series, held by its session observer.
#[derive(Clone)]
pub struct TargetSeries {
    pub steps: Counter,
    pub duration: Histogram,
    pub lost: Counter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_and_labels() {
        let m = Metrics::new();
        let l = TargetLabels {
            node: "n1".into(),
            pid: "42".into(),
            rank: "0".into(),
            job: "41".into(),
            ..Default::default()
        };
        let s = m.target(&l);
        s.steps.inc();
        s.steps.inc();
        s.duration.observe(0.003);
        let text = m.encode();
        assert!(
            text.contains(r#"dynprof_steps_total{node="n1",pid="42",rank="0",job="41",container="",pod_uid="",pod="",namespace=""} 2"#),
            "{text}"
        );
        assert!(
            text.contains("# TYPE dynprof_step_duration_seconds histogram"),
            "{text}"
        );
        // 3 ms falls in the 4 ms bucket, not the 2 ms one.
        let bucket = |le: &str| {
            text.lines()
                .find(|l| l.contains(&format!("_bucket{{le=\"{le}\",")))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_string)
        };
        assert_eq!(bucket("0.002").as_deref(), Some("0"), "{text}");
        assert_eq!(bucket("0.004").as_deref(), Some("1"), "{text}");
        m.remove(&l);
        assert!(!m.encode().contains("pid=\"42\""));
    }

    #[test]
    fn buckets_span_1ms_to_over_100s() {
        let b: Vec<f64> = step_buckets().collect();
        assert_eq!(b.first(), Some(&0.001));
        assert!(*b.last().unwrap() >= 100.0);
    }
}
