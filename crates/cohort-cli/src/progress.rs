//! What a run tells the person who started it, rendered from the run's
//! events ([`cohort_runtime::events`]): a banner before round 1, then where
//! the run is (round, clients of the round, time left).
//!
//! On a terminal the progress is a bar redrawn in place; when stderr is a file
//! or a pipe (CI logs, `2>&1 | tee`) there is no bar to redraw, so each round
//! ends with one plain line instead. `--quiet` shows neither.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use cohort_runtime::events::{RunEvent, RunObserver, round_summary};
use indicatif::{ProgressBar, ProgressStyle};

/// How progress reaches the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProgressMode {
    Hidden,
    /// A bar on a terminal.
    Bar,
    /// One line per round, for logs.
    Lines,
}

impl ProgressMode {
    fn for_stderr(show: bool) -> Self {
        match (show, std::io::stderr().is_terminal()) {
            (false, _) => Self::Hidden,
            (true, true) => Self::Bar,
            (true, false) => Self::Lines,
        }
    }
}

/// The progress of the rounds `first_round..=last_round` of one run.
struct Progress {
    mode: ProgressMode,
    bar: ProgressBar,
    first_round: u32,
    last_round: u32,
    /// When the first round started: the ETA leaves out the wait for client
    /// processes before it.
    started: Option<Instant>,
    round: u32,
    tasks: usize,
    done: usize,
}

impl Progress {
    fn new(mode: ProgressMode, first_round: u32, last_round: u32) -> Self {
        let bar = if mode == ProgressMode::Bar {
            let rounds = (last_round + 1).saturating_sub(first_round);
            let bar = ProgressBar::new(u64::from(rounds));
            bar.set_style(
                ProgressStyle::with_template("{msg} [{bar:24}] {pos}/{len} rounds")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        Self {
            mode,
            bar,
            first_round,
            last_round,
            started: None,
            round: first_round,
            tasks: 0,
            done: 0,
        }
    }

    /// A round starts, waiting for `tasks` clients' outcomes.
    fn start_round(&mut self, round: u32, tasks: usize) {
        self.started.get_or_insert_with(Instant::now);
        self.round = round;
        self.tasks = tasks;
        self.done = 0;
        self.redraw();
    }

    /// One client of the round is done (its update arrived or it was dropped).
    fn client_done(&mut self) {
        self.done = (self.done + 1).min(self.tasks);
        self.redraw();
    }

    /// A line about the round that just ended, with the run's progress: above
    /// the bar on a terminal, on its own in a log.
    fn round_line(&mut self, line: &str) {
        match self.mode {
            ProgressMode::Hidden => {}
            ProgressMode::Bar => {
                self.bar.println(line);
                self.bar.inc(1);
            }
            ProgressMode::Lines => eprintln!(
                "{line} [{}/{} rounds, {}]",
                self.round,
                self.last_round,
                self.time_left_text()
            ),
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }

    fn redraw(&self) {
        if self.mode == ProgressMode::Bar {
            self.bar.set_message(self.bar_message());
        }
    }

    /// What the bar says beside itself: the round, the clients of the round
    /// done so far, and the time left.
    fn bar_message(&self) -> String {
        format!(
            "round {}/{} · {}/{} clients · {}",
            self.round,
            self.last_round,
            self.done,
            self.tasks,
            self.time_left_text()
        )
    }

    fn time_left_text(&self) -> String {
        match self.time_left() {
            Some(left) => format!("ETA {}", clock(left)),
            None => "ETA --:--".to_owned(),
        }
    }

    /// The rest of the run at the pace so far: the work done is the finished
    /// rounds plus the finished share of this one's clients.
    fn time_left(&self) -> Option<Duration> {
        let rounds = f64::from((self.last_round + 1).saturating_sub(self.first_round));
        let within = if self.tasks == 0 {
            0.0
        } else {
            self.done as f64 / self.tasks as f64
        };
        let done = f64::from(self.round.saturating_sub(self.first_round)) + within;
        estimate_left(self.started?.elapsed(), done, rounds)
    }
}

/// Time left when `done` of `total` units took `elapsed`; `None` before any
/// unit is done.
fn estimate_left(elapsed: Duration, done: f64, total: f64) -> Option<Duration> {
    if done <= 0.0 || !done.is_finite() {
        return None;
    }
    let left = elapsed.as_secs_f64() * ((total - done).max(0.0) / done);
    Duration::try_from_secs_f64(left).ok()
}

/// `m:ss`, or `h:mm:ss` past an hour.
fn clock(duration: Duration) -> String {
    let seconds = duration.as_secs();
    let (hours, minutes, seconds) = (seconds / 3600, seconds / 60 % 60, seconds % 60);
    if hours > 0 {
        format!("{hours}:{minutes:02}:{seconds:02}")
    } else {
        format!("{minutes}:{seconds:02}")
    }
}

/// The `cohort` command's view of a run: the banner, the network-mode
/// listening line, and the progress, all on stderr.
pub(crate) struct Terminal {
    show: bool,
    progress: Option<Progress>,
}

impl Terminal {
    /// `show = false` (`--quiet`) renders nothing.
    pub(crate) fn new(show: bool) -> Self {
        Self {
            show,
            progress: None,
        }
    }
}

impl RunObserver for Terminal {
    fn on_event(&mut self, event: &RunEvent) {
        match event {
            RunEvent::RunStarted(facts) => {
                if self.show && facts.leader {
                    for line in facts.banner() {
                        eprintln!("{line}");
                    }
                }
                let mode = ProgressMode::for_stderr(self.show);
                self.progress = Some(Progress::new(mode, facts.first_round, facts.last_round));
            }
            RunEvent::Listening { address } if self.show => {
                eprintln!("listening for client processes on {address}");
            }
            RunEvent::Registered {
                processes,
                expected,
                own_data_missing,
            } if self.show => eprintln!(
                "{}",
                registered_line(*processes, *expected, *own_data_missing)
            ),
            RunEvent::RoundStarted { round, clients } => {
                if let Some(progress) = &mut self.progress {
                    progress.start_round(*round, *clients);
                }
            }
            RunEvent::ClientFinished { .. } | RunEvent::ClientDropped { .. } => {
                if let Some(progress) = &mut self.progress {
                    progress.client_done();
                }
            }
            RunEvent::RoundFinished { row, privacy } => {
                if let Some(progress) = &mut self.progress {
                    progress.round_line(&round_summary(row, privacy.as_ref()));
                }
            }
            RunEvent::RunFinished { .. } => {
                if let Some(progress) = &self.progress {
                    progress.finish();
                }
            }
            _ => {}
        }
    }
}

/// A network-mode server's wait before round 1, in one line.
fn registered_line(processes: usize, expected: usize, own_data_missing: usize) -> String {
    let own = match own_data_missing {
        0 => String::new(),
        n => format!("; {n} own-data client(s) still to register"),
    };
    let state = if processes >= expected && own_data_missing == 0 {
        ": starting round 1"
    } else {
        ", waiting"
    };
    format!("client processes registered: {processes} of {expected}{own}{state}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_for_clients_is_one_line_each_change() {
        assert_eq!(
            registered_line(0, 2, 0),
            "client processes registered: 0 of 2, waiting"
        );
        assert_eq!(
            registered_line(2, 2, 1),
            "client processes registered: 2 of 2; 1 own-data client(s) still to register, waiting"
        );
        assert_eq!(
            registered_line(2, 2, 0),
            "client processes registered: 2 of 2: starting round 1"
        );
    }

    #[test]
    fn time_left_scales_the_pace_so_far() {
        let ten = Duration::from_secs(10);
        assert_eq!(estimate_left(ten, 0.0, 5.0), None);
        assert_eq!(estimate_left(ten, 1.0, 5.0), Some(Duration::from_secs(40)));
        assert_eq!(estimate_left(ten, 2.5, 5.0), Some(ten));
        assert_eq!(estimate_left(ten, 5.0, 5.0), Some(Duration::ZERO));
    }

    #[test]
    fn clocks_read_like_clocks() {
        assert_eq!(clock(Duration::from_secs(9)), "0:09");
        assert_eq!(clock(Duration::from_secs(125)), "2:05");
        assert_eq!(clock(Duration::from_secs(3 * 3600 + 61)), "3:01:01");
    }

    #[test]
    fn the_bar_counts_rounds_and_the_clients_of_the_round() {
        let mut progress = Progress::new(ProgressMode::Hidden, 3, 5);
        progress.start_round(3, 10);
        assert_eq!(
            progress.bar_message(),
            "round 3/5 · 0/10 clients · ETA --:--"
        );
        progress.start_round(4, 10);
        for _ in 0..3 {
            progress.client_done();
        }
        let message = progress.bar_message();
        assert!(
            message.starts_with("round 4/5 · 3/10 clients · ETA "),
            "{message}"
        );
        assert!(!message.ends_with("--:--"), "{message}");
        for _ in 0..9 {
            progress.client_done();
        }
        // Never more clients done than the round has.
        assert_eq!(progress.done, 10);
        assert!(progress.time_left().is_some());
    }
}
