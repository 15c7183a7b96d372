use super::*;

/// The kernel's step counter and plan slot, in memory.
#[derive(Default)]
struct Counter {
    hits: u64,
    plan: Option<PlanConfig>,
}

impl PlanRegister for Counter {
    fn step_hits(&mut self) -> Result<u64> {
        Ok(self.hits)
    }
    fn set_plan(&mut self, cfg: PlanConfig) -> Result<()> {
        self.plan = Some(cfg);
        Ok(())
    }
}

/// A session: the counter, the state machine, and every action so far.
struct Run {
    reg: Counter,
    st: WindowState,
    log: Vec<Action>,
}

impl Run {
    fn new(exit_when_done: bool) -> Self {
        Self {
            reg: Counter::default(),
            st: WindowState::new(exit_when_done),
            log: Vec::new(),
        }
    }

    fn submit(&mut self, plan: Plan, source: Source) -> String {
        let mut out = Vec::new();
        let m = self
            .st
            .submit(PlanRequest::new(plan, source), &mut self.reg, 2, &mut out)
            .unwrap();
        self.log.extend(out);
        m
    }

    /// The next boundary, with the gate as the kernel decides it from
    /// the programmed plan.
    fn step(&mut self) -> Vec<Action> {
        self.reg.hits += 1;
        let k = self.reg.hits;
        let gate = self.reg.plan.is_some_and(|c| c.gate(k));
        let mut out = Vec::new();
        self.st.on_step(
            Boundary {
                k,
                ts_ns: k * 1000,
                gate,
                completed: (k > 1).then_some(k - 1),
                lead: 2,
                now: k,
            },
            &mut self.reg,
            &mut out,
        );
        self.log.extend(out.clone());
        out
    }

    /// Each closed window: (first recorded, last recorded, complete).
    fn windows(&self) -> Vec<(u64, u64, bool)> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Close {
                    steps, complete, ..
                } => Some((steps.first_recorded, steps.last_recorded, *complete)),
                _ => None,
            })
            .collect()
    }

    fn opens(&self) -> Vec<(u64, u64, u64)> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Open { steps, .. } => {
                    Some((steps.first_step, steps.first_recorded, steps.last_recorded))
                }
                _ => None,
            })
            .collect()
    }
}

fn plan(start: i64, warmup: u64, active: u64, repeat: u64, gap: u64) -> Plan {
    Plan {
        start_step: start,
        warmup,
        active,
        repeat,
        gap,
    }
}

#[test]
fn start_warmup_active_records_exactly_those_steps() {
    let mut r = Run::new(true);
    let msg = r.submit(plan(5, 1, 3, 0, 0), Source::Flags);
    assert_eq!(msg, "window records steps 6..8 (warmup from step 5)");
    let mut recorded = Vec::new();
    let mut hooks_at = Vec::new();
    for _ in 0..12 {
        let k = r.reg.hits + 1;
        for a in r.step() {
            match a {
                Action::Record => recorded.push(k - 1),
                Action::StartHooks => hooks_at.push(k),
                _ => {}
            }
        }
    }
    assert_eq!(r.opens(), vec![(5, 6, 8)]);
    assert_eq!(recorded, vec![6, 7, 8]);
    assert_eq!(hooks_at, vec![6]);
    assert_eq!(r.windows(), vec![(6, 8, true)]);
    assert!(r.st.done(), "flags mode ends when the plan is done");
    assert!(r.st.plan().is_none());
    // Armed ahead (two steps before 5, the lead), never after the close.
    let first_arm = r
        .log
        .iter()
        .position(|a| matches!(a, Action::Arm { .. }))
        .unwrap();
    let open = r
        .log
        .iter()
        .position(|a| matches!(a, Action::Open { .. }))
        .unwrap();
    assert!(first_arm < open);
    assert!(r.log.iter().any(|a| matches!(
        a,
        Action::Close {
            disarm: true,
            kernel: None,
            ..
        }
    )));
}

#[test]
fn start_minus_one_opens_at_the_next_boundary() {
    let mut r = Run::new(true);
    for _ in 0..7 {
        r.step();
    }
    let msg = r.submit(plan(-1, 0, 2, 0, 0), Source::Flags);
    assert_eq!(msg, "window records steps 8..9");
    // Next boundary is close: armed at once.
    assert!(matches!(r.log.last(), Some(Action::Arm { collect: None })));
    let out = r.step();
    assert!(out.iter().any(|a| matches!(
        a,
        Action::Open {
            start_hooks: true,
            ..
        }
    )));
    r.step();
    r.step();
    assert_eq!(r.opens(), vec![(8, 8, 9)]);
    assert_eq!(r.windows(), vec![(8, 9, true)]);
}

#[test]
fn a_start_step_already_begun_moves_to_the_next_boundary() {
    let mut r = Run::new(true);
    for _ in 0..10 {
        r.step();
    }
    let msg = r.submit(plan(4, 0, 1, 0, 0), Source::Flags);
    assert_eq!(
        msg,
        "window records steps 11..11 (step 4 had already begun)"
    );
}

#[test]
fn repeat_with_gap_opens_each_cycle() {
    let mut r = Run::new(true);
    r.submit(plan(3, 1, 2, 2, 1), Source::Flags);
    for _ in 0..20 {
        r.step();
    }
    // span 3 + gap 1 = period 4: cycles start at 3, 7, 11.
    assert_eq!(r.opens(), vec![(3, 4, 5), (7, 8, 9), (11, 12, 13)]);
    assert_eq!(
        r.windows(),
        vec![(4, 5, true), (8, 9, true), (12, 13, true)]
    );
    // Between cycles one step apart the collectors stay attached; the
    // last window detaches them.
    let disarms: Vec<bool> = r
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Close { disarm, .. } => Some(*disarm),
            _ => None,
        })
        .collect();
    assert_eq!(disarms, vec![false, false, true]);
    assert!(r.st.done());
}

#[test]
fn stop_closes_an_open_ended_window_at_the_next_boundary() {
    let mut r = Run::new(false);
    let mut out = Vec::new();
    let m =
        r.st.console(ConsoleRequest::Start, &mut r.reg, 2, &mut out)
            .unwrap();
    assert_eq!(m, "window opens at step 1 and runs until `stop`");
    for _ in 0..4 {
        r.step();
    }
    assert_eq!(r.opens(), vec![(1, 1, u64::MAX)]);
    let m = r.st.stop(&mut r.reg, &mut out).unwrap();
    assert_eq!(m, "window 1 closes at the next boundary (step 5)");
    r.step();
    assert_eq!(r.windows(), vec![(1, 4, true)]);
    assert!(r.st.plan().is_none() && r.st.window().is_none());
    assert!(!r.st.done(), "the console stays after a window");
}

#[test]
fn end_at_closes_an_open_ended_window_after_that_step() {
    // Job mode's `stop`: the end is a step ahead, the same job step on
    // every rank, and the gate closes exactly there.
    let mut r = Run::new(false);
    let mut out = Vec::new();
    r.st.console(ConsoleRequest::Start, &mut r.reg, 2, &mut out)
        .unwrap();
    for _ in 0..3 {
        r.step();
    }
    let m = r.st.end_at(6, &mut r.reg, &mut out).unwrap();
    assert_eq!(m, "the window closes after step 6");
    assert_eq!(r.reg.plan.map(|c| c.end), Some(7));
    for _ in 0..3 {
        r.step();
    }
    assert!(r.windows().is_empty(), "step 6 is still in the window");
    r.step();
    assert_eq!(r.windows(), vec![(1, 6, true)]);
    assert!(r.st.plan().is_none() && r.st.window().is_none());
}

#[test]
fn end_at_a_step_already_begun_closes_at_the_next_boundary() {
    let mut r = Run::new(false);
    let mut out = Vec::new();
    r.st.console(ConsoleRequest::Start, &mut r.reg, 2, &mut out)
        .unwrap();
    for _ in 0..5 {
        r.step();
    }
    let m = r.st.end_at(3, &mut r.reg, &mut out).unwrap();
    assert_eq!(
        m,
        "step 3 has already begun: window 1 closes at the next boundary (step 6)"
    );
    r.step();
    assert_eq!(r.windows(), vec![(1, 5, true)]);
}

#[test]
fn quit_with_a_window_open_detaches_after_it() {
    let mut r = Run::new(false);
    let mut out = Vec::new();
    r.st.console(ConsoleRequest::Start, &mut r.reg, 2, &mut out)
        .unwrap();
    r.step();
    r.step();
    let m =
        r.st.console(ConsoleRequest::Quit, &mut r.reg, 2, &mut out)
            .unwrap();
    assert_eq!(
        m,
        "window 1 closes at the next boundary (step 3); detaching after it is written"
    );
    assert!(!r.st.done());
    r.step();
    assert_eq!(r.windows(), vec![(1, 2, true)]);
    assert!(r.st.done());
}

#[test]
fn interrupt_closes_the_open_window_incomplete() {
    let mut r = Run::new(true);
    r.submit(plan(2, 0, 10, 3, 0), Source::Flags);
    for _ in 0..5 {
        r.step();
    }
    let mut out = Vec::new();
    r.st.finish("interrupted".into(), "interrupted", 5, &mut r.reg, &mut out);
    let closes: Vec<_> = out
        .iter()
        .filter_map(|a| match a {
            Action::Close {
                steps,
                complete,
                reason,
                disarm,
                ..
            } => Some((steps.first_recorded, *complete, reason.clone(), *disarm)),
            _ => None,
        })
        .collect();
    assert_eq!(
        closes,
        vec![(2, false, Some("interrupted".to_string()), true)],
        "no further cycle after an interrupt"
    );
    assert_eq!(out.last(), Some(&Action::DisarmAll));
    assert_eq!(r.reg.plan, Some(PlanConfig::DISARMED));
    assert!(r.st.plan().is_none());
}

#[test]
fn target_exit_before_the_window_reports_it_never_reached() {
    let mut r = Run::new(true);
    r.submit(plan(50, 0, 1, 0, 0), Source::Flags);
    r.step();
    let mut out = Vec::new();
    r.st.finish(
        "target exited".into(),
        "the target exited",
        1,
        &mut r.reg,
        &mut out,
    );
    assert_eq!(
        out,
        vec![
            Action::Notice(
                "the planned window (step 50) was never reached: the target exited".into()
            ),
            Action::DisarmAll
        ]
    );
    assert_eq!(r.reg.plan, Some(PlanConfig::DISARMED));
}

#[test]
fn a_request_during_a_window_is_deferred_and_the_last_one_wins() {
    let mut r = Run::new(false);
    r.submit(plan(2, 0, 3, 0, 0), Source::ConfigFile);
    r.step();
    r.step();
    assert_eq!(r.opens().len(), 1);
    let m = r.submit(plan(20, 0, 1, 0, 0), Source::ConfigFile);
    assert_eq!(
        m,
        "window 1 is open; the new plan (start step 20, warmup 0, active 1) starts when it ends (a later change replaces it)"
    );
    r.submit(plan(-1, 1, 2, 0, 0), Source::ConfigFile);
    assert_eq!(r.st.deferred().map(|d| d.plan.warmup), Some(1));
    // The open window is untouched by the deferred requests.
    for _ in 0..3 {
        r.step();
    }
    assert_eq!(r.windows(), vec![(2, 4, true)]);
    // The last request was programmed when the window closed (at step
    // 5: the next boundary is 6, warmup 1).
    let answered: Vec<_> = r
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Answered { ok, msg, .. } => Some((*ok, msg.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        answered,
        vec![(
            true,
            "deferred plan applied: window records steps 7..8 (warmup from step 6)".into()
        )]
    );
    // It starts at the next boundary: the collectors stay armed across the
    // close instead of being attached again after its plan is written.
    let closes: Vec<bool> = r
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Close { disarm, .. } => Some(*disarm),
            _ => None,
        })
        .collect();
    assert_eq!(closes, vec![false]);
    for _ in 0..5 {
        r.step();
    }
    assert_eq!(r.opens(), vec![(2, 2, 4), (6, 7, 8)]);
    assert!(r.st.deferred().is_none());
}

#[test]
fn start_step_zero_cancels_a_pending_plan() {
    let mut r = Run::new(false);
    r.submit(plan(10, 0, 1, 0, 0), Source::Console);
    let m = r.submit(plan(0, 0, 1, 0, 0), Source::Console);
    assert_eq!(m, "start_step 0: no collection planned");
    assert!(r.st.plan().is_none());
    assert_eq!(r.reg.plan, Some(PlanConfig::DISARMED));
    for _ in 0..12 {
        r.step();
    }
    assert!(r.opens().is_empty());
}

#[test]
fn an_unopenable_window_cancels_its_plan() {
    let mut r = Run::new(true);
    r.submit(plan(2, 0, 1, 5, 0), Source::Flags);
    r.step();
    let out = r.step();
    assert!(out.iter().any(|a| matches!(a, Action::Open { .. })));
    let mut out = Vec::new();
    r.st.open_failed(&mut r.reg, &mut out);
    assert_eq!(out, vec![Action::DisarmAll]);
    assert!(r.st.plan().is_none() && r.st.window().is_none());
    assert!(r.st.done());
}

#[test]
fn console_refuses_a_second_window() {
    let mut r = Run::new(false);
    let mut out = Vec::new();
    r.st.console(
        ConsoleRequest::Capture(plan(5, 0, 1, 0, 0)),
        &mut r.reg,
        2,
        &mut out,
    )
    .unwrap();
    let m =
        r.st.console(ConsoleRequest::Start, &mut r.reg, 2, &mut out)
            .unwrap();
    assert_eq!(
        m,
        "a window is already pending (opens at step 5); `stop` cancels it"
    );
    let m = r.st.stop(&mut r.reg, &mut out).unwrap();
    assert_eq!(m, "pending window cancelled");
}
