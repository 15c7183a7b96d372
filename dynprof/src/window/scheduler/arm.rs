//! Arming: collectors and aux markers attached ahead of a window (far
//! enough ahead that attaching ends before its first step) and detached
//! after it, and how a window learns that one went live late.
use super::*;

/// Arm collectors when the window is at most this many boundaries away
/// (the kernel wakes us for exactly these hits)…
const ARM_AHEAD: u64 = crate::window::WAKE_LEAD;
/// …or this many seconds away at the current step rate, whichever is more
/// (attaching the API uprobes and perf events takes a few milliseconds).
const ARM_AHEAD_S: f64 = 0.5;

/// At attach, before the step rate is known, a flags plan that starts
/// within this many steps is armed before it is programmed.
pub(super) const BEGIN_ARM_STEPS: u64 = 10;

/// Steps ahead of a window at which its collectors are armed.
fn arm_ahead(rate: f64) -> u64 {
    let by_time = if rate.is_finite() && rate > 0.0 {
        (rate * ARM_AHEAD_S).ceil() as u64
    } else {
        0
    };
    ARM_AHEAD.max(by_time.min(10_000))
}

/// Why a window is not complete when `what` went live only at step `from`
/// (attached while step `from - 1` ran) and the window records from an
/// earlier step: those steps lack its data. `None` when it was in time.
pub(super) fn late_start(what: &str, from: u64, steps: &OpenSteps) -> Option<String> {
    (from > steps.first_recorded).then(|| {
        format!(
            "{what} went live only during step {}: steps {}..{} lack its data \
             (attaching took longer than the lead; plan the window further ahead)",
            from - 1,
            steps.first_recorded,
            from - 1
        )
    })
}

impl Scheduler {
    /// Attaches the window markers that are not attached yet.
    pub(super) fn attach_window_markers(&mut self, kernel: &mut Kernel) {
        if self.window_markers.is_empty() || self.markers_live_from.is_some() {
            return;
        }
        // Preparation, not a boundary's answer: not at the priority of
        // --realtime-boundaries (attaching uprobes takes milliseconds).
        crate::sys::sched::lower_for_work();
        for p in &self.window_markers {
            if kernel.marker_attached(p.index) {
                continue;
            }
            if let Err(e) = kernel.attach_marker(p) {
                let msg = format!("aux marker `{}` could not be attached: {e:#}", p.label);
                log::warn!("{msg}");
                self.markers_error = Some(msg);
                return;
            }
        }
        self.markers_error = None;
        // A step that began while they were being attached lost hits.
        self.markers_live_from = kernel.state().ok().map(|s| s.step_hits() + 1);
    }

    /// Steps ahead of a window at which its collectors are armed.
    pub(super) fn lead(&self) -> u64 {
        arm_ahead(self.rate)
    }

    pub(super) fn collector_indices(&self, collect: Option<&Vec<Builtin>>) -> Vec<usize> {
        (0..self.collectors.len())
            .filter(|i| match collect.or(self.opts.collect.as_ref()) {
                None => true,
                Some(kinds) => kinds.contains(&self.collectors[*i].kind()),
            })
            .collect()
    }

    /// Arms the collectors of a plan about to be submitted when it starts
    /// within the lead (or `min_lead` steps), before its kernel plan is
    /// programmed: the gate then opens only after they are attached, at
    /// a boundary after the one the counter reached meanwhile. Armed after
    /// the programming instead, a slow attach (many API probes, a loaded
    /// machine) would miss the window's first steps.
    pub(super) fn arm_before(
        &mut self,
        kernel: &mut Kernel,
        plan: &crate::window::Plan,
        collect: Option<&Vec<Builtin>>,
        min_lead: u64,
    ) {
        if self.state.window().is_some() || plan.start_step == 0 {
            return;
        }
        let Ok(c) = kernel.state().map(|s| s.step_hits()) else {
            return;
        };
        if crate::window::first_start(plan, c) <= c + self.lead().max(min_lead) {
            self.arm(kernel, collect);
        }
    }

    pub(super) fn arm(&mut self, kernel: &mut Kernel, collect: Option<&Vec<Builtin>>) {
        self.attach_window_markers(kernel);
        let Some(target) = self.target.clone() else {
            return;
        };
        for i in self.collector_indices(collect) {
            if self.armed[i].is_some() {
                continue;
            }
            // As for the aux markers above.
            crate::sys::sched::lower_for_work();
            let t0 = std::time::Instant::now();
            let r = self.collectors[i].arm(kernel, &target);
            // Arming is on the event loop's path: its time says whether
            // the lead was long enough.
            log::debug!(
                "collector {} armed in {:?} (step hits {:?})",
                self.collectors[i].name(),
                t0.elapsed(),
                kernel.state().map(|s| s.step_hits()).ok()
            );
            match r {
                Ok(()) => {
                    // Read after attaching: a step that began while the
                    // probes were being attached is not covered. (Unknown
                    // step count: assume covered, as before arming.)
                    let live_from = kernel.state().map(|s| s.step_hits() + 1).unwrap_or(0);
                    self.armed[i] = Some(live_from);
                    self.arm_error[i] = None;
                }
                Err(e) => {
                    let msg = format!(
                        "collector {} could not be armed: {e:#}",
                        self.collectors[i].name()
                    );
                    log::warn!("{msg}");
                    self.arm_error[i] = Some(msg.clone());
                    if let Some(c) = &mut self.config {
                        c.error(&msg);
                    }
                }
            }
        }
    }

    pub(super) fn disarm_all(&mut self, kernel: &mut Kernel) {
        for p in &self.window_markers {
            kernel.detach_marker(p.index);
        }
        self.markers_live_from = None;
        for (i, c) in self.collectors.iter_mut().enumerate() {
            if self.armed[i].is_some() {
                c.disarm(kernel);
                self.armed[i] = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(first_recorded: u64) -> OpenSteps {
        OpenSteps {
            id: WindowId(1),
            cycle: 0,
            first_step: first_recorded - 1,
            first_recorded,
            last_recorded: first_recorded + 4,
            hooks_started: false,
        }
    }

    #[test]
    fn a_collector_live_before_the_first_recorded_step_is_in_time() {
        // Armed while step 8 ran: live from step 9, the window records 10..14.
        assert_eq!(late_start("collector api", 9, &steps(10)), None);
        assert_eq!(late_start("collector api", 10, &steps(10)), None);
    }

    #[test]
    fn a_collector_armed_during_the_window_names_the_steps_it_missed() {
        // Armed while step 11 ran: steps 10 and 11 lack its calls.
        let why = late_start("collector api", 12, &steps(10)).expect("late");
        assert!(
            why.starts_with(
                "collector api went live only during step 11: steps 10..11 lack its data"
            ),
            "{why}"
        );
    }
}
