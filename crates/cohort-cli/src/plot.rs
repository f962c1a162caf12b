//! `cohort plot`: accuracy charts of one or more run folders, as PNG.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use plotters::prelude::*;

use cohort_core::results::{RoundRow, parse_results};

/// DejaVu Sans (see assets/DejaVuSans.LICENSE): bundled so charts have text
/// on machines without system fonts.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

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
    let label = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run_dir.display().to_string());
    Ok(Series { label, rows })
}

/// Draws accuracy against round, wall time and simulated time, one line per
/// run, into `output` (a PNG of 1800×500 pixels).
pub fn draw(series: &[Series], output: &Path) -> anyhow::Result<PathBuf> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font could not be loaded"))?;
    let root = BitMapBackend::new(output, (1800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let (left, right, simulated_panel) = (&panels[0], &panels[1], &panels[2]);
    let max_round = series
        .iter()
        .flat_map(|s| s.rows.iter().map(|r| r.round))
        .max()
        .unwrap_or(1);
    let by_round_points = points(|r| f64::from(r.round));
    let by_time_points = points(|r| r.elapsed_time);
    let by_simulated_points = points(|r| r.simulated_time);
    let max_time = axis_end(series, by_time_points);
    let max_simulated = axis_end(series, by_simulated_points);
    let min_accuracy = series
        .iter()
        .flat_map(by_round_points)
        .map(|(_, accuracy)| accuracy)
        .fold(1.0f64, f64::min);
    let floor = (min_accuracy - 0.05).clamp(0.0, 1.0);

    let mut by_round = panel(
        left,
        "Test accuracy by round",
        (0.5..max_round as f64 + 0.5, floor),
        "round",
        Some((max_round as usize + 1).min(20)),
    )?;
    let mut by_time = panel(
        right,
        "Test accuracy by wall time",
        (0.0..max_time, floor),
        "seconds since start",
        None,
    )?;
    let mut by_simulated = panel(
        simulated_panel,
        "Test accuracy by simulated time",
        (0.0..max_simulated, floor),
        "simulated seconds (clients in parallel)",
        None,
    )?;
    for (index, run) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let rounds = by_round_points(run);
        by_round
            .draw_series(LineSeries::new(rounds.clone(), color.stroke_width(2)))?
            .label(run.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        by_round.draw_series(rounds.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        line(&mut by_time, &by_time_points(run), color)?;
        line(&mut by_simulated, &by_simulated_points(run), color)?;
    }
    by_round
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()
        .with_context(|| format!("cannot write {}", output.display()))?;
    Ok(output.to_path_buf())
}

/// A run's points (`x` of each row, its accuracy). Only finite points are
/// drawn: one infinite or NaN value (a results.csv edited by hand, or written
/// before reports were bounded) would make an axis infinite, and plotters
/// loops forever laying out its ticks.
fn points(x: fn(&RoundRow) -> f64) -> impl Fn(&Series) -> Vec<(f64, f64)> + Copy {
    move |run: &Series| -> Vec<(f64, f64)> {
        run.rows
            .iter()
            .map(|r| (x(r), r.accuracy))
            .filter(|&(x, y)| x.is_finite() && y.is_finite())
            .collect()
    }
}

/// Where an axis ends: 5 % past the last point of any run, and never at
/// infinity.
fn axis_end(series: &[Series], points: impl Fn(&Series) -> Vec<(f64, f64)>) -> f64 {
    let max = series
        .iter()
        .flat_map(points)
        .map(|(x, _)| x)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let end = max * 1.05;
    if end.is_finite() { end } else { max }
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One panel of accuracy (from `floor` to 1) against `x`; `round_ticks`
/// labels whole rounds.
fn panel<'a, 'b>(
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    caption: &str,
    (x, floor): (std::ops::Range<f64>, f64),
    x_desc: &str,
    round_ticks: Option<usize>,
) -> anyhow::Result<Chart<'a, 'b>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(x, floor..1.0f64)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(x_desc).y_desc("accuracy");
    let whole = |x: &f64| format!("{x:.0}");
    if let Some(ticks) = round_ticks {
        mesh.x_labels(ticks).x_label_formatter(&whole);
    }
    mesh.draw()?;
    Ok(chart)
}

/// A run's points, joined and marked.
fn line(chart: &mut Chart<'_, '_>, points: &[(f64, f64)], color: RGBAColor) -> anyhow::Result<()> {
    chart.draw_series(LineSeries::new(points.to_vec(), color.stroke_width(2)))?;
    chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    Ok(())
}

/// Stacked bars of each client's samples per label into `output` (PNG): how
/// skewed a partitioning is, at a glance.
pub fn draw_partitions(histograms: &[Vec<u64>], output: &Path) -> anyhow::Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font could not be loaded"))?;
    let clients = histograms.len().max(1);
    let tallest = histograms
        .iter()
        .map(|h| h.iter().sum::<u64>())
        .max()
        .unwrap_or(1)
        .max(1);
    let width = (clients as u32 * 12).clamp(800, 3000);
    let root = BitMapBackend::new(output, (width, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Samples per label, by client", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5f64..clients as f64 + 0.5, 0.0f64..tallest as f64 * 1.05)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("client")
        .y_desc("samples")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (index, histogram) in histograms.iter().enumerate() {
        let x = index as f64 + 1.0;
        let mut bottom = 0.0;
        for (label, &count) in histogram.iter().enumerate() {
            let top = bottom + count as f64;
            let color = Palette99::pick(label).to_rgba().filled();
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.4, bottom), (x + 0.4, top)],
                color,
            )))?;
            bottom = top;
        }
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
        }
    }

    /// `draw` on its own thread: a chart that loops fails the test instead
    /// of hanging it.
    fn draw_within_a_minute(series: Vec<Series>, output: PathBuf) -> anyhow::Result<PathBuf> {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || sender.send(draw(&series, &output)));
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
            "{}\n1,0.5,1,1,1,0.1,10,10,0.5,2,0,,,\n2,0.6,2,1,1,0.1,10,10,0.5,inf,0,,,\n\
             3,NaN,3,1,1,0.1,10,10,0.5,3,0,,,\n4,0.7,1.7e308,1,1,0.1,10,10,0.5,4,0,,,\n",
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
        let written = draw_within_a_minute(series, output.clone()).unwrap();
        assert_eq!(written, output);
        let png = std::fs::read(&output).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // 1800 × 500, big-endian in the IHDR chunk.
        assert_eq!(&png[16..24], &[0, 0, 7, 8, 0, 0, 1, 244]);
    }
}
