// Table: the one printer for every human-readable table slidedpctl shows (layers, ranks, config,
// stats, the status summary). Columns are padded to their widest cell and separated by two spaces;
// left-aligned columns share their start offset on every line, right-aligned (numeric) columns
// share their end offset. Trailing blanks are trimmed.
//
// Widths count UTF-8 code points, not bytes, so non-ASCII names do not shift later columns.
// Thread safety: a Table is a plain value; confine each instance to one thread.
#pragma once

#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

namespace slidedp::ctl {

class Table {
 public:
  enum class Align { kLeft, kRight };
  struct Column {
    std::string header;
    Align align = Align::kLeft;
  };

  explicit Table(std::vector<Column> columns);

  // A two-column KEY/VALUE table printed without a header line (summaries).
  static Table KeyValue();

  void set_show_header(bool show) { show_header_ = show; }

  // Appends a row. Rows shorter than the column count are padded with empty cells; cells beyond
  // the column count are dropped.
  void AddRow(std::vector<std::string> cells);

  size_t num_rows() const { return rows_.size(); }
  size_t num_columns() const { return columns_.size(); }

  // Writes the header (unless hidden) and every row, one line each, '\n'-terminated.
  void Print(std::ostream& out) const;
  std::string ToString() const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
  bool show_header_ = true;
};

// Number of UTF-8 code points in `text` (its display width for the scripts we print).
size_t DisplayWidth(const std::string& text);

}  // namespace slidedp::ctl
