//! `cohort plot`: charts of results.csv columns of one or more run folders,
//! as PNG.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use plotters::prelude::*;

use cohort_core::results::{RESULTS_HEADER, RoundRow, parse_results};

/// DejaVu Sans (see assets/DejaVuSans.LICENSE): bundled so charts have text
/// on machines without system fonts.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

#[derive(Args)]
pub struct PlotArgs {
    /// Run folders; each becomes one line, labelled with the run's name.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The PNG to write [default: accuracy.png in the first run folder].
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// A results.csv column to draw, one row of panels each (repeatable):
    /// accuracy, federated_accuracy, test_loss, train_loss (or loss),
    /// epsilon, round_time, training_time, evaluation_time,
    /// bytes_to_clients, bytes_to_server, … [default: accuracy].
    #[arg(long = "metric", value_name = "COLUMN", value_parser = parse_metric)]
    pub metrics: Vec<Metric>,
    /// What the panels draw against (repeatable): round, wall (seconds since
    /// the run started) or simulated (simulated seconds: a round lasts as
    /// long as its slowest client) [default: all three].
    #[arg(long = "against", value_name = "AXIS", value_enum)]
    pub against: Vec<XAxis>,
}

impl PlotArgs {
    /// What to draw, defaults filled in.
    pub fn chart(&self) -> Chart {
        let default = Chart::default();
        Chart {
            metrics: if self.metrics.is_empty() {
                default.metrics
            } else {
                self.metrics.clone()
            },
            against: if self.against.is_empty() {
                default.against
            } else {
                self.against.clone()
            },
        }
    }
}

/// The rows (metrics) and columns (x axes) of a chart.
pub struct Chart {
    pub metrics: Vec<Metric>,
    pub against: Vec<XAxis>,
}

/// Accuracy by round, by wall time and by simulated time.
impl Default for Chart {
    fn default() -> Self {
        Self {
            metrics: vec![Metric::named("accuracy").expect("accuracy is a column")],
            against: vec![XAxis::Round, XAxis::Wall, XAxis::Simulated],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XAxis {
    Round,
    Wall,
    Simulated,
}

impl XAxis {
    fn of(self, row: &RoundRow) -> f64 {
        match self {
            Self::Round => f64::from(row.round),
            Self::Wall => row.elapsed_time,
            Self::Simulated => row.simulated_time,
        }
    }

    fn description(self) -> &'static str {
        match self {
            Self::Round => "round",
            Self::Wall => "seconds since start",
            Self::Simulated => "simulated seconds (clients in parallel)",
        }
    }

    fn caption(self) -> &'static str {
        match self {
            Self::Round => "by round",
            Self::Wall => "by wall time",
            Self::Simulated => "by simulated time",
        }
    }
}

/// A results.csv column that a chart can draw.
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    column: &'static str,
}

impl Metric {
    /// The column `name` (or `loss`, for train_loss); `None` for a name
    /// results.csv does not have, or for `round`, which is an axis.
    pub fn named(name: &str) -> Option<Self> {
        let name = if name == "loss" { "train_loss" } else { name };
        RESULTS_HEADER
            .split(',')
            .filter(|&column| column != "round")
            .find(|&column| column == name)
            .map(|column| Self { column })
    }

    /// The column's value in `row`, where it has one.
    fn of(&self, row: &RoundRow) -> Option<f64> {
        Some(match self.column {
            "accuracy" => row.accuracy,
            "elapsed_time" => row.elapsed_time,
            "round_time" => row.round_time,
            "training_time" => row.training_time,
            "evaluation_time" => row.evaluation_time,
            "bytes_to_clients" => row.bytes_to_clients as f64,
            "bytes_to_server" => row.bytes_to_server as f64,
            "train_loss" => row.train_loss,
            "simulated_time" => row.simulated_time,
            "extra_bytes_to_clients" => row.extra_bytes_to_clients as f64,
            "federated_accuracy" => row.federated_accuracy?,
            "epsilon" => row.epsilon?,
            "test_loss" => row.test_loss?,
            "simulated_start" => row.simulated_start?,
            other => unreachable!("results.csv column `{other}` has no reader"),
        })
    }

    /// Accuracies are drawn up to 1; everything else spans its values.
    fn is_accuracy(&self) -> bool {
        self.column.ends_with("accuracy")
    }
}

fn parse_metric(name: &str) -> Result<Metric, String> {
    Metric::named(name).ok_or_else(|| {
        let columns: Vec<&str> = RESULTS_HEADER.split(',').skip(1).collect();
        format!(
            "`{name}` is not a results.csv column{}; columns are: {}",
            cohort_core::suggest::did_you_mean(name, columns.iter().copied()),
            columns.join(", ")
        )
    })
}

/// A run's rows and the label of its line.
pub struct Series {
    pub label: String,
    pub rows: Vec<RoundRow>,
}

pub fn load_run(run_dir: &Path) -> anyhow::Result<Series> {
    let path = run_dir.join("results.csv");
    let text = cohort_core::fsutil::read_bounded_text(&path, cohort_core::fsutil::MAX_READ_BYTES)
        .with_context(|| {
        format!(
            "cannot read {} (is {} a run folder?)",
            path.display(),
            run_dir.display()
        )
    })?;
    let rows = parse_results(&text, &path.display().to_string())?;
    if rows.is_empty() {
        bail!("{} has no rounds yet", path.display());
    }
    let label = run_name(run_dir).unwrap_or_else(|| {
        run_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| run_dir.display().to_string())
    });
    Ok(Series { label, rows })
}

/// `general.run_name` of the run folder's config.toml, where it has one.
fn run_name(run_dir: &Path) -> Option<String> {
    let text =
        cohort_core::fsutil::read_bounded_text(&run_dir.join("config.toml"), 1 << 20).ok()?;
    let table: toml::Table = text.parse().ok()?;
    let name = table.get("general")?.get("run_name")?.as_str()?;
    Some(name.to_owned())
}

/// Draws each metric (a row of panels) against each axis (a column of
/// panels), one line per run, into `output` (a PNG of 600×500 pixels a
/// panel).
pub fn draw(series: &[Series], chart: &Chart, output: &Path) -> anyhow::Result<PathBuf> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font could not be loaded"))?;
    let (rows, columns) = (chart.metrics.len(), chart.against.len());
    anyhow::ensure!(rows > 0 && columns > 0, "nothing to draw");
    for metric in &chart.metrics {
        let drawable = series
            .iter()
            .any(|run| !points(run, XAxis::Round, metric).is_empty());
        anyhow::ensure!(
            drawable,
            "no run has a value in results.csv's `{}` column",
            metric.column
        );
    }
    let size = (600 * columns as u32, 500 * rows as u32);
    let root = BitMapBackend::new(output, size).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((rows, columns));
    for (row, metric) in chart.metrics.iter().enumerate() {
        let range = value_range(series, metric);
        for (column, &axis) in chart.against.iter().enumerate() {
            let area = &panels[row * columns + column];
            draw_panel(area, series, metric, axis, range.clone(), column == 0)?;
        }
    }
    root.present()
        .with_context(|| format!("cannot write {}", output.display()))?;
    Ok(output.to_path_buf())
}

/// One panel: `metric` against `axis`, a line per run, the legend in the
/// first panel of each row.
fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    series: &[Series],
    metric: &Metric,
    axis: XAxis,
    values: std::ops::Range<f64>,
    legend: bool,
) -> anyhow::Result<()> {
    let x_range = match axis {
        XAxis::Round => {
            let max_round = series
                .iter()
                .flat_map(|s| s.rows.iter().map(|r| r.round))
                .max()
                .unwrap_or(1);
            0.5..max_round as f64 + 0.5
        }
        _ => 0.0..axis_end(series, axis, metric),
    };
    let caption = format!("{} {}", metric.column, axis.caption());
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range.clone(), values)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(axis.description()).y_desc(metric.column);
    let whole = |x: &f64| format!("{x:.0}");
    if axis == XAxis::Round {
        let max_round = x_range.end - 0.5;
        mesh.x_labels((max_round as usize + 1).min(20))
            .x_label_formatter(&whole);
    }
    mesh.draw()?;
    for (index, run) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let line = points(run, axis, metric);
        // An asynchronous run has a row per aggregation, thousands of them:
        // a marker on each (and a thick line) would bury the other runs.
        let dense = line.len() > MARKED_POINTS;
        let stroke = if dense { 1 } else { 2 };
        let drawn = chart.draw_series(LineSeries::new(line.clone(), color.stroke_width(stroke)))?;
        if legend {
            drawn.label(run.label.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        }
        if !dense {
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
    }
    Ok(())
}

/// The most points a run may have and still get a marker on each.
const MARKED_POINTS: usize = 200;

/// A run's points (`axis` of each row, its `metric`). Only finite points are
/// drawn: one infinite or NaN value (a results.csv edited by hand, or written
/// before reports were bounded) would make an axis infinite, and plotters
/// loops forever laying out its ticks. Rows without the column (a blank
/// epsilon) are left out.
fn points(run: &Series, axis: XAxis, metric: &Metric) -> Vec<(f64, f64)> {
    run.rows
        .iter()
        .filter_map(|r| Some((axis.of(r), metric.of(r)?)))
        .filter(|&(x, y)| x.is_finite() && y.is_finite())
        .collect()
}

/// Where an axis ends: 5 % past the last point of any run, and never at
/// infinity.
fn axis_end(series: &[Series], axis: XAxis, metric: &Metric) -> f64 {
    let max = series
        .iter()
        .flat_map(|run| points(run, axis, metric))
        .map(|(x, _)| x)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let end = max * 1.05;
    if end.is_finite() { end } else { max }
}

/// The value axis of a metric's row: accuracies from a little below the
/// lowest to 1, anything else over its values with a 5 % margin.
fn value_range(series: &[Series], metric: &Metric) -> std::ops::Range<f64> {
    let values: Vec<f64> = series
        .iter()
        .flat_map(|run| points(run, XAxis::Round, metric))
        .map(|(_, y)| y)
        .collect();
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if metric.is_accuracy() {
        return (low - 0.05).clamp(0.0, 1.0).min(0.95)..1.0;
    }
    let margin = ((high - low) * 0.05).max(high.abs() * 1e-3).max(1e-9);
    let bottom = if low >= 0.0 {
        (low - margin).max(0.0)
    } else {
        low - margin
    };
    let top = high + margin;
    if bottom.is_finite() && top.is_finite() && bottom < top {
        bottom..top
    } else {
        0.0..1.0
    }
}

/// Stacked bars of each client's samples per label into `output` (PNG): how
/// skewed a partitioning is, at a glance. Whole numbers on both axes, and a
/// legend of the labels' colours.
pub fn draw_partitions(histograms: &[Vec<u64>], output: &Path) -> anyhow::Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font could not be loaded"))?;
    let clients = histograms.len().max(1);
    let labels = histograms.iter().map(Vec::len).max().unwrap_or(0);
    let tallest = histograms
        .iter()
        .map(|h| h.iter().sum::<u64>())
        .max()
        .unwrap_or(1)
        .max(1);
    let width = (clients as u32 * 12).clamp(800, 3000) + 140;
    let root = BitMapBackend::new(output, (width, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Samples per label, by client", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(120)
        .build_cartesian_2d(0.5f64..clients as f64 + 0.5, 0.0f64..tallest as f64 * 1.05)?;
    let whole = |x: &f64| format!("{x:.0}");
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("client")
        .y_desc("samples")
        .x_labels(clients.min(25))
        .x_label_formatter(&whole)
        .y_label_formatter(&whole)
        .draw()?;
    let mut bottoms = vec![0.0f64; histograms.len()];
    for label in 0..labels {
        let color = Palette99::pick(label).to_rgba();
        let bars: Vec<Rectangle<(f64, f64)>> = histograms
            .iter()
            .zip(bottoms.iter_mut())
            .enumerate()
            .map(|(index, (histogram, bottom))| {
                let count = histogram.get(label).copied().unwrap_or(0) as f64;
                let x = index as f64 + 1.0;
                let bar = Rectangle::new(
                    [(x - 0.4, *bottom), (x + 0.4, *bottom + count)],
                    color.filled(),
                );
                *bottom += count;
                bar
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(format!("label {label}"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    if labels > 0 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()?;
    }
    root.present()
        .with_context(|| format!("cannot write {}", output.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(round: u32, accuracy: f64, elapsed_time: f64, simulated_time: f64) -> RoundRow {
        RoundRow {
            round,
            accuracy,
            elapsed_time,
            round_time: 1.0,
            training_time: 1.0,
            evaluation_time: 0.1,
            bytes_to_clients: 10,
            bytes_to_server: 10,
            train_loss: 0.5,
            simulated_time,
            extra_bytes_to_clients: 0,
            federated_accuracy: None,
            epsilon: None,
            test_loss: None,
            secagg: None,
            simulated_start: None,
            candidates: Vec::new(),
        }
    }

    /// `draw` on its own thread: a chart that loops fails the test instead
    /// of hanging it.
    fn draw_within_a_minute(
        series: Vec<Series>,
        chart: Chart,
        output: PathBuf,
    ) -> anyhow::Result<PathBuf> {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || sender.send(draw(&series, &chart, &output)));
        receiver
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("drawing finishes")
    }

    #[test]
    fn non_finite_points_are_skipped_and_the_chart_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        // Parsed from a results.csv, as `cohort plot` reads it: an infinite
        // simulated time (a report of 1.7e308 s), a NaN accuracy, and the
        // largest finite wall time.
        let csv = format!(
            "{}\n1,0.5,1,1,1,0.1,10,10,0.5,2,0,,,,\n2,0.6,2,1,1,0.1,10,10,0.5,inf,0,,,,\n\
             3,NaN,3,1,1,0.1,10,10,0.5,3,0,,,,\n4,0.7,1.7e308,1,1,0.1,10,10,0.5,4,0,,,,\n",
            cohort_core::results::RESULTS_HEADER
        );
        let rows = parse_results(&csv, "results.csv").unwrap();
        assert!(rows[1].simulated_time.is_infinite() && rows[2].accuracy.is_nan());
        let series = vec![
            Series {
                label: "attacked".into(),
                rows,
            },
            Series {
                label: "honest".into(),
                rows: vec![row(1, 0.4, 1.0, 1.0), row(2, 0.8, 2.0, f64::NEG_INFINITY)],
            },
        ];
        let output = dir.path().join("accuracy.png");
        let written = draw_within_a_minute(series, default_chart(), output.clone()).unwrap();
        assert_eq!(written, output);
        let png = std::fs::read(&output).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // 1800 × 500, big-endian in the IHDR chunk.
        assert_eq!(&png[16..24], &[0, 0, 7, 8, 0, 0, 1, 244]);
    }

    fn default_chart() -> Chart {
        Chart::default()
    }

    #[test]
    fn any_column_can_be_drawn_against_any_axis_and_unknown_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = vec![row(1, 0.4, 1.0, 1.0), row(2, 0.8, 2.0, 3.0)];
        rows[1].epsilon = Some(2.5);
        rows[1].train_loss = 0.25;
        let series = vec![Series {
            label: "dp".into(),
            rows,
        }];
        let chart = Chart {
            metrics: vec![
                parse_metric("loss").unwrap(),
                parse_metric("epsilon").unwrap(),
            ],
            against: vec![XAxis::Simulated],
        };
        let output = dir.path().join("two.png");
        draw_within_a_minute(series, chart, output.clone()).unwrap();
        let png = std::fs::read(&output).unwrap();
        // One column of two rows: 600 × 1000.
        assert_eq!(&png[16..24], &[0, 0, 2, 88, 0, 0, 3, 232]);

        let error = parse_metric("acuracy").unwrap_err();
        assert!(
            error.contains("`acuracy` is not a results.csv column")
                && error.contains("did you mean `accuracy`"),
            "{error}"
        );
        assert!(parse_metric("round").is_err());
        // Every column of the header has a reader.
        for column in RESULTS_HEADER.split(',').skip(1) {
            let metric = parse_metric(column).unwrap();
            let _ = metric.of(&row(1, 0.5, 1.0, 1.0));
        }
    }

    #[test]
    fn a_column_no_run_has_is_an_error_not_an_empty_chart() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![Series {
            label: "plain".into(),
            rows: vec![row(1, 0.4, 1.0, 1.0)],
        }];
        let chart = Chart {
            metrics: vec![parse_metric("epsilon").unwrap()],
            against: vec![XAxis::Round],
        };
        let error = draw_within_a_minute(series, chart, dir.path().join("e.png")).unwrap_err();
        assert!(error.to_string().contains("`epsilon`"), "{error}");
    }

    #[test]
    fn a_run_is_labelled_with_its_recorded_name() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("noniid-1767225600");
        std::fs::create_dir(&run).unwrap();
        std::fs::write(
            run.join("results.csv"),
            format!("{}\n1,0.5,1,1,1,0.1,10,10,0.5,2,0,,,,\n", RESULTS_HEADER),
        )
        .unwrap();
        assert_eq!(load_run(&run).unwrap().label, "noniid-1767225600");
        std::fs::write(
            run.join("config.toml"),
            "[general]\nrun_name = \"noniid-fedprox\"\n",
        )
        .unwrap();
        assert_eq!(load_run(&run).unwrap().label, "noniid-fedprox");
    }
}
