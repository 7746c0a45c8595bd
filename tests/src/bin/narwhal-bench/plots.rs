//! Line charts of the scaling results as SVG files (the `plotters` crate, its SVG backend:
//! no system fonts, text sized by plotters' own estimate).
//!
//! One chart per cost: x is the fleet size (engines) or the concurrency, y the cost in the unit
//! its title names, one line per series (a build, a peer, an engines-per-agent setting).

use std::path::Path;

use plotters::prelude::*;

/// One line of a chart: its legend and its `(x, y)` points, in the order drawn.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    /// Legend text.
    pub name: String,
    /// Points; a `NaN` y (a failed measurement) is left out.
    pub points: Vec<(f64, f64)>,
}

/// A chart: `title`, axis labels (with units), its series.
#[derive(Debug, Clone)]
pub(crate) struct Chart {
    /// Caption above the plot.
    pub title: String,
    /// X axis label, with its unit.
    pub x_label: String,
    /// Y axis label, with its unit.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// Colours of the series, in order (then repeated).
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Writes `chart` to `path` as an SVG of 720 x 420 pixels; both axes start at zero.
///
/// # Errors
/// A message naming `path` when it cannot be drawn or written.
pub(crate) fn write_svg(path: &Path, chart: &Chart) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    // Each series' drawable points (a failed measurement left out).
    let lines: Vec<Vec<(f64, f64)>> = chart
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect()
        })
        .collect();
    let (mut x_max, mut y_max) = (0.0f64, 0.0f64);
    for (x, y) in lines.iter().flatten() {
        x_max = x_max.max(*x);
        y_max = y_max.max(*y);
    }
    let x_max = if x_max > 0.0 { x_max * 1.05 } else { 1.0 };
    let y_max = if y_max > 0.0 { y_max * 1.15 } else { 1.0 };
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut ctx = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| fail(&e))?;
    let x_fmt = |v: &f64| tick(*v, x_max);
    let y_fmt = |v: &f64| tick(*v, y_max);
    ctx.configure_mesh()
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .x_desc(&chart.x_label)
        .y_desc(&chart.y_label)
        .draw()
        .map_err(|e| fail(&e))?;
    for (i, (s, pts)) in chart.series.iter().zip(&lines).enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        ctx.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(&s.name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        ctx.draw_series(pts.iter().map(|p| Circle::new(*p, 3, colour.filled())))
            .map_err(|e| fail(&e))?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// A tick label of `v` on an axis reaching `max`: whole numbers from 10 up, else as many
/// decimals as the axis needs.
fn tick(v: f64, max: f64) -> String {
    match max {
        m if m >= 10.0 => format!("{v:.0}"),
        m if m >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_an_svg_with_every_series_in_its_legend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.svg");
        let chart = Chart {
            title: "router CPU per request".into(),
            x_label: "engines".into(),
            y_label: "µs".into(),
            series: vec![
                Series {
                    name: "8 per agent".into(),
                    points: vec![(4.0, 290.0), (64.0, 385.0), (256.0, f64::NAN)],
                },
                Series {
                    name: "1 per agent".into(),
                    points: vec![(4.0, 300.0)],
                },
            ],
        };
        write_svg(&path, &chart).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        for text in [
            "router CPU per request",
            "8 per agent",
            "1 per agent",
            "engines",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
    }
}
