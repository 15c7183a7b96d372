//! The interactive console (`dynprof>`), at parity with `msprof --dynamic=on`.
//!
//! Runs on its own OS thread (never blocking the event loop, and never
//! holding the process open at exit). Each line becomes a [`ConsoleCommand`]
//! on the session's command channel; the scheduler's answer is printed.
//! With a terminal, `rustyline` gives line editing and history; with piped
//! stdin, one command per line is read and every answer printed, so a
//! script can drive it. EOF means `quit`.
use std::io::{BufRead as _, IsTerminal as _, Write as _};

use anyhow::{Result, bail};
use tokio::sync::mpsc::UnboundedSender;

use super::{
    ConsoleCommand, ConsoleRequest, NoticePrinter, SessionCommand as Command, SetNoticePrinter,
};
use crate::window::Plan;

pub const PROMPT: &str = "dynprof> ";

pub const HELP: &str = "\
commands:
  start                         open a window at the next step boundary; it runs until `stop`
  stop                          close the open window at the next boundary (or cancel a pending one)
  capture A [warmup W] [at S]   record A steps after W warmup steps, from step S (default: next boundary)
  status                        steps seen, step rate, window state, windows written
  quit                          end any window cleanly, detach, leave the target running
  help                          this text";

/// What one input line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    Empty,
    Help,
    Req(ConsoleRequest),
}

fn num(word: Option<&str>, what: &str) -> Result<u64> {
    match word.map(str::parse::<u64>) {
        Some(Ok(v)) => Ok(v),
        Some(Err(_)) => bail!("{what}: `{}` is not a number", word.unwrap_or("")),
        None => bail!("{what}: a number is missing"),
    }
}

pub fn parse_line(line: &str) -> Result<Line> {
    let mut w = line.split_whitespace();
    let Some(cmd) = w.next() else {
        return Ok(Line::Empty);
    };
    let rest: Vec<&str> = w.collect();
    let no_args = |r: ConsoleRequest| -> Result<Line> {
        if rest.is_empty() {
            Ok(Line::Req(r))
        } else {
            bail!("`{cmd}` takes no arguments")
        }
    };
    match cmd.to_ascii_lowercase().as_str() {
        "start" => no_args(ConsoleRequest::Start),
        "stop" => no_args(ConsoleRequest::Stop),
        "status" => no_args(ConsoleRequest::Status),
        "quit" | "exit" => no_args(ConsoleRequest::Quit),
        "help" | "?" => Ok(Line::Help),
        "capture" => {
            let mut it = rest.iter().copied();
            let active = num(it.next(), "capture A")?;
            if active == 0 {
                bail!("capture A: A must be at least 1");
            }
            let mut plan = Plan {
                start_step: -1,
                warmup: 0,
                active,
                repeat: 0,
                gap: 0,
            };
            while let Some(k) = it.next() {
                match k {
                    "warmup" => plan.warmup = num(it.next(), "warmup W")?,
                    "at" => {
                        let s = num(it.next(), "at S")?;
                        if s == 0 {
                            bail!("at S: steps are numbered from 1");
                        }
                        plan.start_step = s as i64;
                    }
                    other => {
                        bail!("capture: unexpected `{other}` (usage: capture A [warmup W] [at S])")
                    }
                }
            }
            Ok(Line::Req(ConsoleRequest::Capture(plan)))
        }
        other => bail!("unknown command `{other}`; type `help`"),
    }
}

/// Starts the console thread. `tty`: use rustyline (prompt, editing,
/// history); otherwise read plain lines from stdin.
pub fn spawn(tx: UnboundedSender<Command>, force_plain: bool) -> Result<()> {
    let tty = !force_plain && std::io::stdin().is_terminal();
    std::thread::Builder::new()
        .name("dynprof-console".into())
        .spawn(move || {
            if tty {
                run_tty(tx);
            } else {
                run_plain(tx);
            }
        })?;
    Ok(())
}

/// Sends one request and waits for its answer; None when the session is gone.
fn ask(tx: &UnboundedSender<Command>, req: ConsoleRequest) -> Option<String> {
    let (rtx, rrx) = std::sync::mpsc::channel();
    tx.send(Command::Console(ConsoleCommand { req, reply: rtx }))
        .ok()?;
    rrx.recv().ok().map(|r| r.text)
}

/// Handles one line; returns false when the console should end.
fn handle(tx: &UnboundedSender<Command>, line: &str, out: &mut dyn FnMut(&str)) -> bool {
    match parse_line(line) {
        Ok(Line::Empty) => true,
        Ok(Line::Help) => {
            out(HELP);
            true
        }
        Ok(Line::Req(req)) => {
            let quit = req == ConsoleRequest::Quit;
            match ask(tx, req) {
                Some(text) => {
                    out(&text);
                    !quit
                }
                None => false,
            }
        }
        Err(e) => {
            out(&format!("error: {e:#}"));
            true
        }
    }
}

fn run_plain(tx: UnboundedSender<Command>) {
    let printer: NoticePrinter = Box::new(|m: String| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{m}");
        let _ = o.flush();
    });
    let _ = tx.send(Command::SetNoticePrinter(SetNoticePrinter(printer)));
    let mut out = |s: &str| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{s}");
        let _ = o.flush();
    };
    out("dynprof console ready; type `help` for commands");
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        if !handle(&tx, &line, &mut out) {
            return;
        }
    }
    // EOF = quit.
    if let Some(t) = ask(&tx, ConsoleRequest::Quit) {
        out(&t);
    }
}

fn run_tty(tx: UnboundedSender<Command>) {
    use rustyline::{DefaultEditor, ExternalPrinter as _, error::ReadlineError};
    let mut rl = match DefaultEditor::new() {
        Ok(rl) => rl,
        Err(e) => {
            eprintln!("dynprof: line editing unavailable ({e}); reading plain lines");
            return run_plain(tx);
        }
    };
    if let Ok(mut p) = rl.create_external_printer() {
        let printer: NoticePrinter = Box::new(move |m: String| {
            let _ = p.print(format!("{m}\n"));
        });
        let _ = tx.send(Command::SetNoticePrinter(SetNoticePrinter(printer)));
    }
    let mut out = |s: &str| println!("{s}");
    out("dynprof console ready; type `help` for commands");
    loop {
        match rl.readline(PROMPT) {
            Ok(line) => {
                if !line.trim().is_empty() {
                    let _ = rl.add_history_entry(line.as_str());
                }
                if !handle(&tx, &line, &mut out) {
                    return;
                }
            }
            Err(ReadlineError::Interrupted) | Err(ReadlineError::Eof) => break,
            Err(e) => {
                eprintln!("dynprof: console: {e}");
                break;
            }
        }
    }
    if let Some(t) = ask(&tx, ConsoleRequest::Quit) {
        out(&t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands() {
        assert_eq!(parse_line("  ").unwrap(), Line::Empty);
        assert_eq!(
            parse_line("start").unwrap(),
            Line::Req(ConsoleRequest::Start)
        );
        assert_eq!(parse_line("STOP").unwrap(), Line::Req(ConsoleRequest::Stop));
        assert_eq!(
            parse_line("capture 3 warmup 1 at 20").unwrap(),
            Line::Req(ConsoleRequest::Capture(Plan {
                start_step: 20,
                warmup: 1,
                active: 3,
                repeat: 0,
                gap: 0
            }))
        );
        assert_eq!(
            parse_line("capture 2").unwrap(),
            Line::Req(ConsoleRequest::Capture(Plan {
                start_step: -1,
                warmup: 0,
                active: 2,
                repeat: 0,
                gap: 0
            }))
        );
        assert!(parse_line("capture").is_err());
        assert!(parse_line("capture x").is_err());
        assert!(parse_line("capture 2 at").is_err());
        assert!(
            parse_line("frobnicate")
                .unwrap_err()
                .to_string()
                .contains("help")
        );
        assert!(parse_line("start now").is_err());
    }
}
